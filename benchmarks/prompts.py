"""Workload prompts for the end-to-end suites (our own text) and the check of each answer.

Each domain cell is one chat turn chosen to stress speculation differently: the two
extraction cells copy most of their output from the prompt (high acceptance), the json cell
invents structured records, the two code cells write Python, the math cell reasons with
thinking on, and the prose cell writes free text (low acceptance). Each cell has a check so
that speed is never reported without the health of the output beside it (did it stop by
itself, is the JSON valid, does the code parse, is the integer answer right).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Callable

from .metrics import final_integer


@dataclass(frozen=True)
class Check:
    status: str  # "pass" | "fail" | "n/a"
    detail: str


@dataclass(frozen=True)
class Cell:
    name: str
    prompt: str
    thinking: bool
    check: Callable[[str], Check]


_INVOICE = """\
INVOICE No. HV-2291
Issued 3 March 2026
From: Harbour Valve Works Ltd, 14 Quay Street, Leith EH6 6LX
Bill to: North Ridge Brewing Co., 2 Mill Lane, Perth PH1 5QA
Currency: GBP
- 12 x brass gate valve DN25 @ 18.40 = 220.80
- 4 x PTFE seal kit @ 6.25 = 25.00
- 1 x pressure test, on site @ 95.00 = 95.00
Subtotal 340.80
VAT 20% 68.16
Total due 408.96, payable within 30 days to account 40-11-62 / 55501234."""

_LOGS = """\
2026-02-11T08:00:03Z INFO  api-gateway  request id=7f1c path=/orders status=200 ms=41
2026-02-11T08:00:04Z WARN  billing      retrying charge id=ch_118 attempt=2 reason=timeout
2026-02-11T08:00:04Z INFO  api-gateway  request id=7f1d path=/orders/118 status=200 ms=17
2026-02-11T08:00:06Z ERROR billing      charge failed id=ch_118 attempt=3 reason=card_declined
2026-02-11T08:00:06Z INFO  notifier     email queued to=ops@example.org template=charge_failed
2026-02-11T08:00:09Z INFO  scheduler    job started name=nightly-export shard=3
2026-02-11T08:00:15Z WARN  scheduler    job slow name=nightly-export shard=3 elapsed_s=6.2
2026-02-11T08:00:21Z INFO  scheduler    job finished name=nightly-export shard=3 rows=18234"""

_LOG_LINES = len(_LOGS.splitlines())


def extract_json(text: str):
    """The JSON value in a response: inside a ```json fence if there is one, else from the
    first '{' or '[' to the last matching closer. Raises ValueError when none parses."""
    fenced = re.findall(r"```(?:json)?\s*\n(.*?)```", text, re.DOTALL)
    candidates = fenced + [text]
    for cand in candidates:
        starts = [i for i in (cand.find("{"), cand.find("[")) if i >= 0]
        if not starts:
            continue
        start = min(starts)
        end = max(cand.rfind("}"), cand.rfind("]"))
        if end <= start:
            continue
        try:
            return json.loads(cand[start:end + 1])
        except json.JSONDecodeError:
            continue
    raise ValueError("no parseable JSON in the response")


def extract_python(text: str) -> str:
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, re.DOTALL)
    return max(blocks, key=len) if blocks else text


def _check_doc2json(text: str) -> Check:
    try:
        data = extract_json(text)
    except ValueError as e:
        return Check("fail", str(e))
    total = data.get("total") if isinstance(data, dict) else None
    if isinstance(total, str):
        try:
            total = float(total.replace(",", ""))
        except ValueError:
            pass
    if isinstance(total, (int, float)) and abs(total - 408.96) < 0.005:
        return Check("pass", "valid JSON, total 408.96")
    return Check("fail", f"valid JSON but total is {total!r}, expected 408.96")


def _check_log2json(text: str) -> Check:
    try:
        data = extract_json(text)
    except ValueError as e:
        return Check("fail", str(e))
    if isinstance(data, dict):  # {"records": [...]} is acceptable
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else data
    if isinstance(data, list) and len(data) == _LOG_LINES:
        return Check("pass", f"valid JSON, {_LOG_LINES} records")
    n = len(data) if isinstance(data, list) else type(data).__name__
    return Check("fail", f"valid JSON but {n} records, expected {_LOG_LINES}")


def _check_json_records(text: str) -> Check:
    try:
        data = extract_json(text)
    except ValueError as e:
        return Check("fail", str(e))
    if isinstance(data, list) and len(data) == 12 and all(isinstance(r, dict) for r in data):
        return Check("pass", "valid JSON, 12 records")
    n = len(data) if isinstance(data, list) else type(data).__name__
    return Check("fail", f"valid JSON but {n} records, expected 12 objects")


def _check_python(required: str) -> Callable[[str], Check]:
    def check(text: str) -> Check:
        code = extract_python(text)
        try:
            tree = ast.parse(code)
        except SyntaxError as e:
            return Check("fail", f"code does not parse: {e.msg} (line {e.lineno})")
        except ValueError as e:  # e.g. null bytes, on Pythons that raise ValueError for them
            return Check("fail", f"code does not parse: {e}")
        names = {n.name for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
        if required in names:
            return Check("pass", f"code parses, defines {required}")
        return Check("fail", f"code parses but defines no {required}")
    return check


def integer_check(expected: int) -> Callable[[str], Check]:
    def check(text: str) -> Check:
        got = final_integer(text)
        if got is None:
            return Check("fail", f"no integer answer, expected {expected}")
        return Check("pass" if got == expected else "fail", f"answer {got}, expected {expected}")
    return check


def _check_prose(text: str) -> Check:
    words = len(text.split())
    return Check("n/a", f"{words} words")


DISTINCT_ITEMS = 50


def _check_distinct_items(text: str) -> Check:
    """Seed 002's test of a broken quantization: ask for 50 distinct items; a healthy model names
    50 of 50, a broken one repeats itself (4 of 50 there, one entry 50 times)."""
    from .health import distinct_items

    entries, distinct, top, top_count = distinct_items(text)
    ok = distinct >= DISTINCT_ITEMS and top_count == 1
    return Check("pass" if ok else "fail",
                 f"{distinct} distinct of {entries} entries (asked for {DISTINCT_ITEMS}); most repeated: "
                 f"{top!r} x{top_count}")


MATH_CELL_ANSWER = 130  # n <= 1000 divisible by 7 (142) minus those divisible by 77 (12)

CELLS: dict[str, Cell] = {c.name: c for c in [
    Cell("doc2json",
         "Convert the invoice below into a single JSON object with the keys invoice_number, "
         "issue_date (YYYY-MM-DD), seller {name, address}, buyer {name, address}, currency, "
         "line_items (a list of {description, quantity, unit_price, amount}), subtotal, "
         "tax_rate, tax, total, payment_terms_days and bank_account. Numbers as JSON numbers. "
         "Reply with the JSON only.\n\n" + _INVOICE,
         False, _check_doc2json),
    Cell("log2json",
         "Turn every line of the log below into one JSON record with the keys timestamp, "
         "level, service, message and fields (an object of the key=value pairs, numbers as "
         "numbers). Reply with a JSON array only, one record per line, in order.\n\n" + _LOGS,
         False, _check_log2json),
    Cell("json",
         "Generate a JSON array of 12 records describing fictional weather stations. Each "
         "record has id ('WS-001' to 'WS-012'), name, country, latitude, longitude, "
         "elevation_m, commissioned_year, sensors (a list of sensor names) and active (a "
         "boolean). Reply with the JSON array only.",
         False, _check_json_records),
    Cell("mergesort",
         "Write a Python function merge_sort(items) that returns a new sorted list using "
         "top-down merge sort with a separate merge(left, right) helper. Use type hints and "
         "docstrings, keep it stable, and finish with a few assert statements that test it. "
         "Reply with one python code block.",
         False, _check_python("merge_sort")),
    Cell("code",
         "Implement an AVL tree in Python: a class AVLTree with insert(key), delete(key), "
         "contains(key) and in-order iteration through __iter__. Keep node heights up to date "
         "and rebalance with single and double rotations after every change. Reply with one "
         "python code block.",
         False, _check_python("AVLTree")),
    Cell("math",
         "How many positive integers n with n <= 1000 are divisible by 7 but not by 11? "
         "Reason it out, then give the final answer as \\boxed{N}.",
         True, integer_check(MATH_CELL_ANSWER)),
    Cell("distinct50",
         f"List {DISTINCT_ITEMS} different given names for characters in a fantasy novel, one per "
         "line, with no numbering and nothing else.",
         False, _check_distinct_items),
    Cell("prose",
         "Write a short story of about 400 words about a lighthouse keeper who finds a "
         "message in a bottle written in her own handwriting, dated next year.",
         False, _check_prose),
]}

# The five-seed reasoning problem: inclusion-exclusion over 2, 3 and 5 up to 10,000.
# Divisible by at least one: 5000 + 3333 + 2000 - 1666 - 1000 - 666 + 333 = 7334;
# divisible by none: 10000 - 7334 = 2666.
REASONING_PROBLEM = (
    "How many integers from 1 to 10000 inclusive are divisible by none of 2, 3 and 5? "
    "Think it through carefully, then give the final answer as \\boxed{N}.")
REASONING_ANSWER = 2666
