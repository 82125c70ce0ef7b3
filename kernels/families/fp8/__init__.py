"""The FP8 family: e4m3 codes one per byte times a float32 scale per tensor or per output channel
(value = e4m3(byte) * scale); ModelOpt's FP8 and compressed-tensors float 8-bit tensor / channel.

  members.py   the WeightFormat members, per tensor and per channel (data; routes qpn8*)
  codec.py     canonical source, exact decoders, the encoder
  layout.py    fragment maps per atom, PackedFP8, prepack, its inverse and the proof
  numerics.py  CPU reference and FP8Numerics (kernels/families/contract.py)
  loader.py    the loader schema: the tensors a module stores, the sources (shard fusion)
CUDA decoders: DecFP8 (m8n8k4.cuh) and Frag16FP8 (m16n8k16.cuh); its sm_80+ kernels and route
tables: kernels_sm80.py. Grouped MoE kernels exist on both atoms.
"""
