"""`python -m specdec.kernels`: build the native kernels now (make setup does) and say where they are."""

from . import attention_lib, forward_lib, matmul_isa, matmul_lib, sample_lib

lib = attention_lib()
print(f"attention kernel: {lib._name}" if lib else "attention kernel: not built, PyTorch SDPA will be used")
lib = matmul_lib()
print(f"matmul kernel: {lib._name} ({matmul_isa()})" if lib else "matmul kernel: not used (no compiler, or neither "
      "AVX-512 VNNI nor AVX2), PyTorch's weight-only kernels will be")
lib = sample_lib()
print(f"sampling kernel: {lib._name}" if lib else "sampling kernel: not built, torch.topk and torch ops will be used")
lib = forward_lib()
print(f"forward kernel: {lib._name}" if lib else "forward kernel: not built, layers are called one kernel at a time")
