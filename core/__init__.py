"""The shared base every package stands on: typed recipe configs and user errors, the one model
loader (which honours a hybrid-attention spec saved in the config), checkpoints and run folders,
durable writes, tiny models built in code and the built-in offline corpus."""

import logging

# Once torchao (the optional int8 export) is installed, transformers imports it with every model
# class, and on a CPU-only torch it logs a warning for each CUDA kernel library it cannot load (and
# torch one per enum it registers). They say nothing actionable and would bury our one-line errors.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
