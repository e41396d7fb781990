"""`python -m specdec.kernels`: build the native kernels now (make setup does) and say where they are."""

from . import attention_lib

lib = attention_lib()
print(f"attention kernel: {lib._name}" if lib else "attention kernel: not built, PyTorch SDPA will be used")
