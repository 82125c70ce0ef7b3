"""The INT4 family's loader schema (kernels/families/contract.py FamilyLoader): the integer
families' shared schema (kernels/families/integer.py) with 4-bit codes, eight to an int32 word,
read by this family's AWQ / GPTQ / compressed-tensors unpackers (checkpoint.py)."""
from __future__ import annotations

from ..integer import IntegerLoader
from . import checkpoint
from .codec import unpack_codes
from .members import STORED_DTYPES

LOADER = IntegerLoader(bits=4, checkpoint=checkpoint, to_values=unpack_codes, stored_dtypes=STORED_DTYPES)
