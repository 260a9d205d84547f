"""A small stock-keeping tool for a workshop: items live in a CSV file, the command line adds,
removes and lists them, and a report flags what is running low."""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path

LOW_STOCK_THRESHOLD = 5
DEFAULT_PATH = Path("inventory.csv")
FIELDS = ("sku", "name", "quantity", "unit_price", "location")


class InventoryError(Exception):
    """Raised for a bad command: an unknown SKU, a negative quantity, a malformed row."""


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    unit_price: float
    location: str = "main"

    @property
    def value(self) -> float:
        return self.quantity * self.unit_price

    def to_row(self) -> dict[str, str]:
        return {"sku": self.sku, "name": self.name, "quantity": str(self.quantity),
                "unit_price": f"{self.unit_price:.2f}", "location": self.location}

    @classmethod
    def from_row(cls, row: dict[str, str]) -> "Item":
        try:
            return cls(row["sku"], row["name"], int(row["quantity"]), float(row["unit_price"]),
                       row.get("location") or "main")
        except (KeyError, ValueError) as e:
            raise InventoryError(f"malformed row {row!r}: {e}") from None


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add(self, item: Item) -> None:
        if item.quantity < 0:
            raise InventoryError(f"{item.sku}: quantity must not be negative")
        if item.sku in self.items:
            self.items[item.sku].quantity += item.quantity
        else:
            self.items[item.sku] = item

    def remove(self, sku: str, quantity: int) -> Item:
        item = self.get(sku)
        if quantity > item.quantity:
            raise InventoryError(f"{sku}: only {item.quantity} in stock, cannot remove {quantity}")
        item.quantity -= quantity
        return item

    def restock(self, sku: str, quantity: int) -> Item:
        item = self.get(sku)
        item.quantity += quantity
        return item

    def get(self, sku: str) -> Item:
        try:
            return self.items[sku]
        except KeyError:
            raise InventoryError(f"unknown SKU {sku}") from None

    def low_stock(self) -> list[Item]:
        return sorted((i for i in self.items.values() if i.quantity <= LOW_STOCK_THRESHOLD),
                      key=lambda i: (i.quantity, i.sku))

    def total_value(self) -> float:
        return sum(i.value for i in self.items.values())

    def by_location(self) -> dict[str, list[Item]]:
        out: dict[str, list[Item]] = {}
        for item in self.items.values():
            out.setdefault(item.location, []).append(item)
        return out


def load(path: Path) -> Inventory:
    inv = Inventory()
    if not path.exists():
        return inv
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            inv.add(Item.from_row(row))
    return inv


def save(inv: Inventory, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for sku in sorted(inv.items):
            writer.writerow(inv.items[sku].to_row())
    tmp.replace(path)


def format_price(amount: float) -> str:
    return f"{amount:,.2f} EUR"


def print_table(items: list[Item]) -> None:
    print(f"{'SKU':<10} {'NAME':<24} {'QTY':>5} {'PRICE':>12} {'LOCATION':<10}")
    for i in items:
        print(f"{i.sku:<10} {i.name:<24} {i.quantity:>5} {format_price(i.unit_price):>12} {i.location:<10}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="workshop inventory")
    parser.add_argument("--file", type=Path, default=DEFAULT_PATH)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("add")
    p.add_argument("sku")
    p.add_argument("name")
    p.add_argument("quantity", type=int)
    p.add_argument("unit_price", type=float)
    p.add_argument("--location", default="main")
    p = sub.add_parser("remove")
    p.add_argument("sku")
    p.add_argument("quantity", type=int)
    p = sub.add_parser("restock")
    p.add_argument("sku")
    p.add_argument("quantity", type=int)
    sub.add_parser("list")
    sub.add_parser("report")
    args = parser.parse_args(argv)

    inv = load(args.file)
    try:
        if args.command == "add":
            inv.add(Item(args.sku, args.name, args.quantity, args.unit_price, args.location))
        elif args.command == "remove":
            inv.remove(args.sku, args.quantity)
        elif args.command == "restock":
            inv.restock(args.sku, args.quantity)
        elif args.command == "list":
            print_table(sorted(inv.items.values(), key=lambda i: i.sku))
        elif args.command == "report":
            print(f"{len(inv.items)} items, total value {format_price(inv.total_value())}")
            for location, items in sorted(inv.by_location().items()):
                print(f"  {location}: {len(items)} items")
            low = inv.low_stock()
            if low:
                print(f"low stock (<= {LOW_STOCK_THRESHOLD}):")
                print_table(low)
    except InventoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command in ("add", "remove", "restock"):
        save(inv, args.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
