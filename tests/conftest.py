import os

import torch

# Triton kernels run on CPU tensors only in the interpreter, which must be
# chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
