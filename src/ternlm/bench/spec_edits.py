"""The code-editing conversation of `ternlm bench spec`, as pure data: a user pastes a ~170-line module
(tests/data/inventory.py, written for this repository) and asks for one small change a turn; the answer
each turn is the whole file. The history's assistant turns are FIXED (the previous file with the asked
change applied by plain string edits, below), so every contender is sent the same prompts whatever it
answered; only the current turn's answer is generated (and timed). Nothing here starts or reads a model."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[3] / "tests" / "data" / "inventory.py"
SYSTEM = ("You are a careful coding assistant. When the user asks for a change, reply with the complete "
          "updated file in a single ```python code block and nothing else.")


@dataclass(frozen=True)
class Edit:
    """One turn's request and how the benchmark applies it: each (old, new) replaces every occurrence of
    `old`, which must occur (a missing one means the edits and the file drifted apart: an error)."""
    request: str
    replace: tuple[tuple[str, str], ...]


EDITS = (
    Edit("Rename the class `Inventory` to `Stockroom` everywhere (and `InventoryError` to `StockroomError`).",
         (("Inventory", "Stockroom"),)),
    Edit("Change the low-stock threshold from 5 to 10.",
         (("LOW_STOCK_THRESHOLD = 5", "LOW_STOCK_THRESHOLD = 10"),)),
    Edit('Add a `currency` parameter to `format_price`, defaulting to "EUR", and use it instead of the '
         "hard-coded currency.",
         (('def format_price(amount: float) -> str:\n    return f"{amount:,.2f} EUR"',
           'def format_price(amount: float, currency: str = "EUR") -> str:\n    return f"{amount:,.2f} {currency}"'),)),
    Edit("Add a docstring to the `restock` method.",
         (("    def restock(self, sku: str, quantity: int) -> Item:\n",
           "    def restock(self, sku: str, quantity: int) -> Item:\n"
           '        """Add `quantity` units of `sku` to the stock and return the updated item."""\n'),)),
    Edit("Make `restock` reject a quantity that is not positive, raising `StockroomError`.",
         (('the updated item."""\n        item = self.get(sku)\n',
           'the updated item."""\n        if quantity <= 0:\n'
           '            raise StockroomError(f"{sku}: restock quantity must be positive, got {quantity}")\n'
           "        item = self.get(sku)\n"),)),
    Edit("Add a `--verbose` flag to the command line that prints which file is used.",
         (('    parser.add_argument("--file", type=Path, default=DEFAULT_PATH)\n',
           '    parser.add_argument("--file", type=Path, default=DEFAULT_PATH)\n'
           '    parser.add_argument("--verbose", action="store_true", help="print which file is used")\n'),
          ("    args = parser.parse_args(argv)\n",
           "    args = parser.parse_args(argv)\n    if args.verbose:\n"
           '        print(f"using {args.file}", file=sys.stderr)\n'))),
)
MAX_TURNS = len(EDITS)


def apply(source: str, edit: Edit) -> str:
    """`source` with `edit` applied. Pure; raises ValueError when an `old` is not in `source`."""
    for old, new in edit.replace:
        if old not in source:
            raise ValueError(f"edit {edit.request!r}: {old[:40]!r} not found")
        source = source.replace(old, new)
    return source


def files(source: str, turns: int) -> list[str]:
    """[the pasted file, after edit 1, ..., after edit `turns`]. Pure."""
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"--turns must be 1..{MAX_TURNS}, got {turns}")
    out = [source]
    for e in EDITS[:turns]:
        out.append(apply(out[-1], e))
    return out


def fenced(code: str) -> str:
    return f"```python\n{code}```"


def conversation(source: str, turns: int) -> list[list[dict]]:
    """The messages of each turn (system, user, [fixed assistant, user]...), ending with that turn's
    request. Turn k's history holds the files after edits 1..k-1 as the assistant's answers. Pure."""
    fs = files(source, turns)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is `inventory.py`:\n\n{fenced(fs[0])}\n\n{EDITS[0].request}"}]
    out = [list(msgs)]
    for k in range(1, turns):
        msgs += [{"role": "assistant", "content": fenced(fs[k])}, {"role": "user", "content": EDITS[k].request}]
        out.append(list(msgs))
    return out


def expected(source: str, turns: int) -> list[str]:
    """The file each turn's answer should contain (what the fixed history says next). Pure."""
    return files(source, turns)[1:]


_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.S)


def answered_file(text: str) -> str | None:
    """The code block of an answer (the first one), or None when it has none (or it never closed). Pure."""
    m = _FENCE.search(text)
    return m.group(1) if m else None
