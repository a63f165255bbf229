"""The exact core: what makes speculative decoding give the plain model's output, and nothing else.

Step types, the tree, the acceptance rules, sampling, stopping, the KV cache, the backbone adapter,
and the passes and loop that run them (``decode.decode_rows``). It imports only torch, transformers
and itself: nothing here knows what machine it runs on. How a machine runs it (width fitting, the
compiled static step) lives in ``selfspec.runtime`` and reaches the loop through the named seams of
``decode_rows`` (``cost=``, ``step=``).
"""
