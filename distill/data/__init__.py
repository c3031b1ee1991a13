"""Training data: sources, prepare-once memory-mapped blocks, mixtures, and a resumable order.

The built-in corpus (:mod:`core.corpus`) is the docstrings of the Python standard library; its
held-out docstrings come from other files than its training ones.

User data goes through ``datasets``: local ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` files or
directories, or a hub name when online. Records with a ``messages`` list (chat format) are
rendered with the tokenizer's chat template; with ``completion_only`` (the default) only assistant
tokens are training targets and the prompt is context (``Blocks.loss_mask``).

Documents are tokenized with every core (local ``.jsonl``: forked workers over byte ranges,
:mod:`distill.data.parallel`; other sources: ``datasets.map(num_proc=...)``), joined with EOS, and
packed into fixed ``[seq_len]`` blocks stored as uint16/uint32 in memory-mapped files under the
data cache (:mod:`distill.data.prepare`); no padding, so every micro-batch holds the same number of
tokens. With completion-only masks the number of targets differs, and the recipes weight each
micro-batch's loss by its targets (:func:`distill.training.token_weights`) so that a step is still a mean
over its tokens. Held-out documents are chosen per document, before
packing, so no document straddles the split. Several sources mix by weight
(:class:`~distill.data.order.MixtureOrder`), the order a pure function of ``(seed, step)``; a source
marked ``streaming`` is read on the fly instead (:mod:`distill.data.stream`), alone or in a mixture.

    python -m distill.data prepare --config recipes/configs/NAME.yaml [key=value ...]
"""

from distill.data import text
from distill.data.corpus import Blocks, PackedData, SourceReport, build_data, eval_batches, steps_for_tokens
from distill.data.order import BlockOrder, MixtureOrder, permute
from distill.data.prepare import PackSettings, data_cache_root, open_prepared, prepare_source
from distill.data.text import (
    BUILTIN,
    DataError,
    SourceSpec,
    pack,
    parse_sources,
    stdlib_docs,
    texts_from,
    tokenizer_fingerprint,
)

__all__ = [
    "BUILTIN", "BlockOrder", "Blocks", "DataError", "MixtureOrder", "PackSettings", "PackedData", "SourceReport",
    "SourceSpec", "build_data", "data_cache_root", "eval_batches", "open_prepared", "pack", "parse_sources",
    "permute", "prepare_source", "stdlib_docs", "steps_for_tokens", "text", "texts_from", "tokenizer_fingerprint",
]
