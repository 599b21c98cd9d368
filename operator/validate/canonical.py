"""What the Kubernetes API server does to a built-in object before storing it, as pure functions.

A built-in object (Deployment, Service, NetworkPolicy, ...) is decoded into Go structs and
encoded again, so what a GET returns is not byte-for-byte what was sent:

* resource quantities come back in canonical form: ``"0.5"`` -> ``"500m"``, ``"1024Mi"`` ->
  ``"1Gi"``, ``4`` -> ``"4"`` (k8s.io/apimachinery ``resource.Quantity``);
* empty lists disappear (``omitempty`` on slices): ``egress: []`` is stored as no ``egress``.

The operator compares its desired objects with live ones; without these rules a desired
``"0.5"`` never equals a live ``"500m"`` and every resync would send a no-op patch.
The unit tests' emulator (harness/kube_emulator.py) applies the same rules so the tests see what a cluster stores.
Custom resources are stored as sent (no Go types), so callers apply this to built-in kinds only
for storage, while comparisons may use it on both sides of anything.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Literal

Format = Literal["DecimalSI", "BinarySI", "DecimalExponent"]

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {v: k for k, v in _DECIMAL.items()}
_BINARY_SUFFIX = {0: "", **{v: k for k, v in _BINARY.items()}}
# An exponent ("1e3") is tried before the suffixes so that "1E" stays exa and "1E3" is 1000.
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$")

# Where quantities sit in the objects kuberl builds: ``resources.requests`` / ``resources.limits``
# (core/v1 ResourceRequirements), a pod's ``overhead`` and ``emptyDir.sizeLimit``. (A SandboxPool's
# ``spec.limits`` holds plain numbers: ``limits`` alone is not enough to mean quantities.)
_RESOURCE_MAPS = frozenset({"requests", "limits"})


def parse_quantity(value: str | int | float) -> tuple[Fraction, Format]:
    """A quantity's exact value and format; ValueError for anything Kubernetes would reject.

    Like ``resource.ParseQuantity`` the value is rounded up to nano units (1e-9).
    """
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"quantity {value!r} does not match the Kubernetes quantity syntax")
    number, exponent, suffix = m.group(1), m.group(2), m.group(3) or ""
    amount = Fraction(number)
    fmt: Format
    if exponent is not None:
        amount *= Fraction(10) ** int(exponent)
        fmt = "DecimalExponent"
    elif suffix in _BINARY:
        amount *= 1024 ** _BINARY[suffix]
        fmt = "BinarySI"
    else:
        amount *= Fraction(10) ** _DECIMAL[suffix]
        fmt = "DecimalSI"
    nanos = amount * 10**9
    if nanos.denominator != 1:  # sub-nano precision rounds away from zero, as the API server does
        nanos = Fraction(math.ceil(abs(nanos)) * (1 if nanos >= 0 else -1))
    return nanos / 10**9, fmt


def canonical_quantity(value: str | int | float) -> str:
    """The string the API server stores for a quantity (``resource.Quantity.String()``)."""
    amount, fmt = parse_quantity(value)
    if amount == 0:
        return "0"
    if fmt == "BinarySI" and (abs(amount) < 1024 or amount.denominator != 1):
        fmt = "DecimalSI"  # small or fractional binary amounts are shown in decimal, exactly
    sign = "-" if amount < 0 else ""
    if fmt == "BinarySI":
        n, power = abs(int(amount)), 0
        while n % 1024 == 0 and power < 6:
            n, power = n // 1024, power + 1
        return f"{sign}{n}{_BINARY_SUFFIX[power]}"
    # Decimal: the largest exponent (a multiple of 3) that keeps the mantissa an integer.
    mantissa, exp = abs(int(amount * 10**9)), -9
    while mantissa % 1000 == 0:
        mantissa, exp = mantissa // 1000, exp + 3
    if fmt == "DecimalExponent":
        return f"{sign}{mantissa}" + (f"e{exp}" if exp else "")
    if exp > 18:  # beyond exa there is no suffix: carry the rest in the mantissa
        mantissa, exp = mantissa * 10 ** (exp - 18), 18
    return f"{sign}{mantissa}{_DECIMAL_SUFFIX[exp]}"


def _canonical_or_same(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return value
    try:
        return canonical_quantity(value)
    except ValueError:
        return value  # not a quantity after all: leave it for the server's validation to reject


def server_form(obj: Any, key: str | None = None) -> Any:
    """``obj`` as the API server would store it (quantities canonical, empty lists dropped)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if isinstance(v, list) and not v:
                continue
            quantity_map = k == "overhead" or (key == "resources" and k in _RESOURCE_MAPS)
            if quantity_map and isinstance(v, dict):
                out[k] = {q: _canonical_or_same(x) for q, x in v.items()}
            elif k == "sizeLimit":
                out[k] = _canonical_or_same(v)
            else:
                out[k] = server_form(v, k)
        return out
    if isinstance(obj, list):
        return [server_form(v, key) for v in obj]
    return obj
