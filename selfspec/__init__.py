"""selfspec: exact self-speculative decoding for Hugging Face causal LMs."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import selfspec` (and the CLI's --help) stays fast.
    if name == "SelfSpeculativeModel":
        from .model import SelfSpeculativeModel

        return SelfSpeculativeModel
    raise AttributeError(name)


__all__ = ["SelfSpeculativeModel", "__version__"]
