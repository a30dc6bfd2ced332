"""Integer helpers for sizes, tiles and grids, shared by the engine, layers and kernel wrappers.
Plain Python: no torch or Triton import, so any module can use them."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (b > 0): triton.cdiv's arithmetic."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x; 1 for x <= 1."""
    return 1 << max(0, (int(x) - 1).bit_length())


def prev_pow2(x: int) -> int:
    """The largest power of two <= x (x >= 1); 0 for x < 1."""
    return 1 << (x.bit_length() - 1) if x >= 1 else 0
