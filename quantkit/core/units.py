"""Sizes in messages."""


def size_text(n: int) -> str:
    """Bytes for a message, with enough digits that a small size never reads 0.0: GiB from 10 MiB up, else MiB
    (KiB below one MiB)."""
    if n >= 10 * 2**20:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
