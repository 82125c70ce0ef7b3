"""The INT8 family's loader schema (kernels/families/contract.py FamilyLoader): the integer
families' shared schema (kernels/families/integer.py) with 8-bit codes, four to an int32 word, read
by this family's GPTQ / compressed-tensors unpackers (checkpoint.py). The canonical codes are one
uint8 per input already."""
from __future__ import annotations

from ..integer import IntegerLoader
from . import checkpoint
from .members import STORED_DTYPES

LOADER = IntegerLoader(bits=8, checkpoint=checkpoint, to_values=lambda codes: codes,
                       stored_dtypes=STORED_DTYPES)
