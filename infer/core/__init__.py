"""Hardware-neutral core: never imports a backend, triton or torch_npu."""
