"""How a machine runs the exact core: width fitting by measured costs (``width``), the back-off that
turns drafting off where it does not pay (``backoff``), and the compiled static-shape step
(``step``, ``static``). Each reaches the loop only through an argument of
``core.decode.decode_rows``; nothing in ``selfspec.core`` imports this package.
"""
