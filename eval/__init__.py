"""Evaluation: perplexity / bits per byte / teacher agreement (``eval.metrics``) and the release gate
(``python -m eval.gate``; ``eval.gate.run_gate``) that scores candidate vs baseline with BERTScore."""
