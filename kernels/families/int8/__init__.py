"""The INT8 W8A16 family: unsigned 8-bit codes one per byte, one float16 scale per group of 32, 64
or 128 inputs or per output channel, and (asymmetric member) one uint8 zero point per group; the
symmetric member's zero point is the constant 128 (value = (code - zero) * scale). GPTQ /
GPTQModel and compressed-tensors pack-quantized checkpoints with 8-bit weights.

  members.py       the WeightFormat members, asymmetric and symmetric (data; routes qpn8i*), staged
  codec.py         canonical source, exact decoders, the encoder
  checkpoint.py    the GPTQ and compressed-tensors unpackers into the canonical source, g_idx
  layout.py        fragment maps per atom, PackedINT8, prepack, its inverse and the proof
  numerics.py      CPU reference and INT8Numerics (kernels/families/contract.py)
  kernels_sm80.py  its sm_80+ kernels (data) and their route tables
CUDA decoders: DecINT8 / DecINT8Sym (m8n8k4.cuh, entry points
qpn8i[_sym]_{mt1,mt2,reconstruct_ws}_m8n8k4) and Frag16INT8* (m16n8k16.cuh; in the tiled routes'
kernels Frag16INT8Fold*, the group scale applied to FP32 sums for records of 64 inputs or more).
A per-channel weight is one group record per row spanning all of K (members.py says why), run by
the same kernels. The family is registered but not served: no loader method or checkpoint
convention reads INT8 checkpoints yet, so its routes qpn8i, qpn8i_mt2, qpn8i_chunked,
qpn8i_reconstruct are routes.UNSERVED_ROUTES (ops runs them). There are no INT8 MoE kernels.
"""
