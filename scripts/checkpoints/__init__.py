"""Checkpoint makers: the input end of the data path, for the demonstration and the tests.

Small mixed NVFP4/FP8 checkpoints of the Qwen3.5/3.8 hybrid family in both conventions
(``make_checkpoint``: ModelOpt; ``make_ct_checkpoint``: compressed-tensors; ``make_moe_checkpoint``:
the MoE variant; ``modelopt_export``: the same model through ModelOpt's own exporter;
``make_int4_checkpoint``: the same model as INT4 W4A16, AutoAWQ or compressed-tensors), built from a
tiny float model (``tiny_hybrid``) and tokenizer (``tiny_tokenizer``, ``tiny_chat_template.jinja``),
and the float references served outputs are compared against (``checkpoint_reference``,
``ct_reference``).
"""
