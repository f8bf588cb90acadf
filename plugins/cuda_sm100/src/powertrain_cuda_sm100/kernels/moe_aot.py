"""What the kernels' ``aot_specs`` share: the specialisation a runtime launch gets.

A launch through ``kernel[grid](...)`` specialises every pointer that is 16-byte
aligned and every int divisible by 16; an ahead-of-time ``ASTSource`` knows only
what its ``attrs`` say.
"""

from __future__ import annotations


def divisibility_attrs(fn, signature: dict[str, str], aligned: tuple[str, ...]) -> dict:
    """``ASTSource`` attrs saying that every pointer and the ``aligned`` ints are multiples
    of 16, as the launcher's specialisation finds them for real model widths. Without
    them the compiler cannot prove 16-byte alignment, issues no ``cp.async`` and does
    not pipeline the K loop (``num_stages`` is then ignored)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(fn.arg_names)
        if signature[arg].startswith("*") or arg in aligned
    }
