import os
import tempfile

import pytest

# Keep every cache inside a temp dir and never reach a hub.
_CACHE = tempfile.mkdtemp(prefix="hd-test-cache-")
for var, sub in [("HF_HOME", "hf"), ("WANDB_DIR", "wandb"), ("MPLCONFIGDIR", "mpl"),
                 ("TORCH_EXTENSIONS_DIR", "torch_ext"), ("TRITON_CACHE_DIR", "triton")]:
    os.environ.setdefault(var, os.path.join(_CACHE, sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models gain nothing from threads, and two threads on a busy 2-core CI box are far slower.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
