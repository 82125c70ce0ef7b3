"""The NVFP4 family: e2m1 codes two per byte, one e4m3 scale per 16 inputs, one float32 global
multiplier (value = e2m1(code) * e4m3(group scale) * global); ModelOpt's NVFP4 / W4A16_NVFP4
checkpoints and compressed-tensors nvfp4-pack-quantized.

  members.py   the WeightFormat member (data; routes qpn2*)
  codec.py     canonical source, exact decoders, the encoder
  layout.py    fragment maps per atom, PackedNVFP4, prepack, its inverse and the proof
  numerics.py  CPU reference and NVFP4Numerics (kernels/families/contract.py)
  loader.py    the loader schema: the tensors a module stores, the sources (shard fusion)
CUDA decoders: DecNVFP4 / DecNVFP4S7 (m8n8k4.cuh) and Frag16NVFP4* (m16n8k16.cuh); its sm_80+
kernels and route tables: kernels_sm80.py. Grouped MoE kernels exist on both atoms.
"""
