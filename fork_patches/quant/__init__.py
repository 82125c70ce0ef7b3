"""The QPN quantization method: registered config, checkpoint conventions, linear and MoE methods, TP sharding."""
