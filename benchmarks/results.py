"""Results files: a CSV and a Markdown table, written row by row.

Both files carry the run's provenance header. The CSV keeps it as ``# key: value`` comment
lines above the column row (``read_results`` and pandas' ``comment='#'`` skip them); every
row is flushed and fsynced as soon as it is measured, so an interrupted run keeps what it
finished. The Markdown file is rewritten (atomically) after every row. Summary lines and a
closing error, when there is one, are appended to both.
"""
from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    key: str
    label: str  # Markdown header
    digits: int | None = None  # None: write as text


def _fmt(value, digits):
    if value is None or value == "":
        return ""
    if digits is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return ""
        return f"{value:.{digits}f}"
    return str(value)


class ResultsWriter:
    def __init__(self, prefix: str, title: str, header: dict[str, str], columns: list[Column]):
        self.csv_path = prefix + ".csv"
        self.md_path = prefix + ".md"
        self.title = title
        self.header = dict(header)
        self.columns = columns
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.error: str | None = None
        os.makedirs(os.path.dirname(os.path.abspath(self.csv_path)), exist_ok=True)
        with open(self.csv_path, "w", newline="") as f:
            for key, value in self.header.items():
                f.write(f"# {key}: {_one_line(value)}\n")
            csv.writer(f).writerow([c.key for c in columns])
            _sync(f)
        self._write_md()

    def add_row(self, row: dict) -> None:
        unknown = set(row) - {c.key for c in self.columns}
        if unknown:
            raise KeyError(f"row has keys the table does not declare: {sorted(unknown)}")
        self.rows.append(dict(row))
        with open(self.csv_path, "a", newline="") as f:
            csv.writer(f).writerow([_csv_value(row.get(c.key)) for c in self.columns])
            _sync(f)
        self._write_md()

    def add_note(self, text: str) -> None:
        self.notes.append(text)
        with open(self.csv_path, "a") as f:
            f.write(f"# note: {_one_line(text)}\n")
            _sync(f)
        self._write_md()

    def fail(self, message: str) -> None:
        self.error = message
        with open(self.csv_path, "a") as f:
            f.write(f"# error: {_one_line(message)}\n")
            _sync(f)
        self._write_md()

    def _write_md(self) -> None:
        out = io.StringIO()
        out.write(f"# {self.title}\n\n")
        for key, value in self.header.items():
            out.write(f"- **{key}**: {_one_line(value)}\n")
        out.write("\n| " + " | ".join(c.label for c in self.columns) + " |\n")
        out.write("|" + "|".join("---:" if c.digits is not None else "---" for c in self.columns)
                  + "|\n")
        for row in self.rows:
            cells = [_fmt(row.get(c.key), c.digits).replace("|", "\\|") for c in self.columns]
            out.write("| " + " | ".join(cells) + " |\n")
        if self.notes:
            out.write("\n" + "\n".join(f"- {n}" for n in self.notes) + "\n")
        if self.error:
            out.write(f"\n**Run stopped early:** {_one_line(self.error)} "
                      f"({len(self.rows)} rows above were finished before it stopped.)\n")
        tmp = self.md_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(out.getvalue())
            _sync(f)
        os.replace(tmp, self.md_path)


def _csv_value(value) -> str:
    """Full precision in the CSV (the Markdown table rounds)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if not math.isfinite(value) else repr(round(value, 6))
    return str(value)


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _one_line(text) -> str:
    return " ".join(str(text).split())


def read_results(csv_path: str) -> tuple[dict[str, str], list[dict[str, str]], list[str]]:
    """(header, rows, trailing comment lines such as notes and errors) of a results CSV."""
    header: dict[str, str] = {}
    trailing: list[str] = []
    data_lines: list[str] = []
    with open(csv_path, newline="") as f:
        for line in f:
            if line.startswith("# "):
                body = line[2:].rstrip("\n")
                if not data_lines:
                    key, _, value = body.partition(": ")
                    header[key] = value
                else:
                    trailing.append(body)
            else:
                data_lines.append(line)
    rows = list(csv.DictReader(data_lines))
    return header, rows, trailing
