"""QPN kernels: formats, prepack, reference, route table, CUDA sources and their bindings."""
