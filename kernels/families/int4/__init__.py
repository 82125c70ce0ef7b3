"""The INT4 W4A16 family: unsigned 4-bit codes two per byte, one float16 scale per group of 32, 64
or 128 inputs and (asymmetric member) one uint4 zero point per group; the symmetric member's zero
point is the constant 8 (value = (code - zero) * scale). AutoAWQ, GPTQ and compressed-tensors
pack-quantized checkpoints.

  members.py     the WeightFormat members, asymmetric and symmetric (data; routes qpn4*)
  codec.py       canonical source, exact decoders, the encoder
  checkpoint.py  the AWQ, GPTQ and compressed-tensors unpackers into the canonical source, g_idx
  layout.py      fragment maps per atom, PackedINT4, prepack, its inverse and the proof
  numerics.py    CPU reference and INT4Numerics (kernels/families/contract.py)
  loader.py      the loader schema: each convention's stored tensors, the sources, the proofs
CUDA decoders: DecINT4 / DecINT4Sym (m8n8k4.cuh, entry points
qpn4[_sym]_{mt1,mt2,reconstruct_ws}_m8n8k4) and Frag16INT4* (m16n8k16.cuh; in the tiled routes'
kernels Frag16INT4Fold*, the group scale applied to FP32 sums for groups of 64 and 128); which
kernel serves which route and layer size is kernels_sm80.py. loader.py is the loader schema
through which the one QPN linear method (fork_patches/quant/linear_method.py) serves the
checkpoints, on the routes qpn4, qpn4_mt2, qpn4_chunked, qpn4_reconstruct. There are no INT4 MoE kernels.
"""
