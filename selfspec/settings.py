"""Every decoding default in one place, and each drafter's per-step settings as a typed, checked config.

``DRAFTER_SETTINGS`` declares, per drafter, which per-step settings it takes (tree, threshold,
gate, lookup) and their defaults; a setting a drafter does not take is None there, and giving it
is refused with one line. "auto" means: the value ``selfspec tune-tree`` measured fastest for the
heads in use (the ``decode`` section of their ``config.json``, a ``DecodeSettings``), else the
drafter's default. ``from_pretrained``, ``selfspec generate`` and ``selfspec bench`` all check and
resolve settings through :func:`check_settings` and :func:`resolve_settings`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

DEFAULT_MAX_NEW_TOKENS = 128     # generate(), `selfspec generate` and `selfspec bench` alike
DEFAULT_NUM_HEADS = 4            # Medusa heads
DEFAULT_TOKEN_INPUT = True       # Medusa heads also read the root token's embedding (known when drafting)
DEFAULT_LOOKUP = 8               # context tokens the lookup drafter copies per step (tune-tree chose 8 for the demo's heads)
DEFAULT_EAGLE_TREE = "dynamic-5-4-8"   # depth 5, expand 4, keep 8 nodes (before tune-tree measures better)
DEFAULT_CHAIN_TREE = "chain-4"   # early exit and the draft model: a chain of 4
# The corpus lookup (corpus.py): n-grams of these lengths are looked up in the target's own earlier
# answers, and a proposed chain goes on while at least CORPUS_MIN_COUNT occurrences and
# CORPUS_MIN_SHARE of them agree on the next token (chosen by replaying the lookup over the target's
# greedy answers to held-out and dev prompts: tokens accepted a step against the extra nodes' cost).
CORPUS_MIN_NGRAM, CORPUS_MAX_NGRAM = 2, 4
CORPUS_MIN_COUNT, CORPUS_MIN_SHARE = 2, 0.5
CORPUS_HELP = ("lookup / medusa / eagle: where the context has no match, the lookup proposes what followed in the "
               "target's own earlier answers: a directory from `selfspec build-corpus`; auto = the one shipped for "
               "the demo model, none = off. Output is unchanged")
# Batches: the chance a copied token is accepted, where no draft distribution says it (a lookup's
# context or corpus copy; a drafter that gives no probabilities): COPY_ACCEPT_FIRST for a first copied
# token, times COPY_ACCEPT_NEXT for each one after it. The lookup's measured acceptance by depth on
# held-out chat prompts was 0.59, 0.46, 0.37, 0.31, 0.27 (0.66, 0.49, 0.34, 0.30, 0.25 on dev).
COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT = 0.6, 0.8
# A chain copied from the context says more: its chance depends on how long the match that found it
# was. (first copied token, each next one given the one before), for matches of 1, 2, 3 and 4 or more
# tokens: a single repeated token's copy is right about a quarter of the time, a match of four
# tokens' nearly nine times in ten. Measured by `python scripts/lookup_priors.py` on the demo
# model's own greedy answers (training/data/smollm2-135m-{broad-cpu,broad-self,broad-gpu,greedy},
# the last 300 of each, 40,158 chains: broad chat prompts, maths and code), replaying the lookup
# step by step; each set alone gave first chances within 0.07 of these.
COPY_ACCEPT_BY_MATCH = ((0.23, 0.67), (0.48, 0.76), (0.55, 0.78), (0.88, 0.95))
# The same when sampling (width fitting cuts sampled trees too), where a copied token is accepted only
# as often as the target's distribution draws it: at temperature 0.7 on held-out chat prompts the
# lookup's acceptance by depth was 0.51, 0.25, 0.14, 0.11 with the corpus, 0.50, 0.42, 0.33, 0.26
# reading the context alone.
COPY_ACCEPT_SAMPLED_FIRST, COPY_ACCEPT_SAMPLED_NEXT = 0.5, 0.6
# ... and by match length, as COPY_ACCEPT_BY_MATCH (a copied token is accepted with the target's
# probability of it, so the share of sampled answers that continue as the copy does is that chance):
# the same script on the target's answers sampled at temperature 0.7 (training/data/smollm2-135m-t0.7).
COPY_ACCEPT_SAMPLED_BY_MATCH = ((0.20, 0.53), (0.40, 0.63), (0.54, 0.70), (0.73, 0.88))
# Medusa's sparse tree for 4 heads (paths of candidate ranks): wide near the root where heads are
# accurate, thin deeper; 15 nodes. `selfspec tune-tree` replaces it with what measures fastest.
MEDUSA_DEFAULT: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0),
)


def default_exit_layer(num_layers: int) -> int:
    """Where early exit leaves the target when no layer is given: halfway (LayerSkip's and Draft & Verify's choice)."""
    return num_layers // 2


AUTO = ("auto", None)
# The device whose tune-tree settings a heads directory's decode section holds at its top level (the
# others', e.g. a GPU's, sit under its ``devices``), and which every device without its own reads.
HOME_DEVICE = "cpu"


def is_device_type(kind) -> bool:
    """A device type that may hold settings of its own (``torch.device.type``: lower-case, not the CPU's)."""
    return isinstance(kind, str) and kind.isidentifier() and kind.islower() and kind != HOME_DEVICE


@dataclass(frozen=True)
class DecodeSettings:
    """The ``decode`` section of a heads directory's ``config.json``: per-step settings measured
    fastest for these heads by ``selfspec tune-tree`` (all off until it has run).

    One record per kind of device and mode: a user who turns the lookup off (``lookup=0``) gets the same
    tree, threshold and gate without it (width fitting cuts each step's tree to what it pays on the
    machine anyway). An older tune-tree's ``without_lookup`` record is read and dropped.

    ``sampled``: the settings ``tune-tree --temperature`` measured fastest when sampling, which "auto"
    gives a sampled ``generate``. Sampling accepts
    fewer drafted tokens than greedy decoding, so a tree and threshold tuned greedy draft deeper
    than sampling repays; None: sampling reads the greedy settings.

    ``devices``: settings tune-tree measured on another kind of device than a CPU, as
    ``((device type, DecodeSettings), ...)`` (config.json: ``"devices": {"cuda": {...}}``), each a whole
    section of its own (with its ``sampled``). A GPU verifies 60 nodes for about
    the price of one, a CPU does not, so the tree that pays on one is not the tree that pays on the
    other. The rest of the section is the CPU's (``HOME_DEVICE``), and what a device without settings
    of its own reads (``for_device``)."""

    tree: str | list | None = None    # a tree spec ("chain-3", "dynamic-4-2-4", a list of paths); None: the drafter's default
    threshold: float = 0.0
    gate: float = 0.0
    lookup: int = 0
    sampled: "DecodeSettings | None" = None
    devices: tuple = ()

    @classmethod
    def from_json(cls, raw, *, section: str = "decode", where: str = "its decode section") -> "DecodeSettings":
        """``section``: "decode" (the whole section), "device" (one device's: no devices of its own) or
        "sampled" (its sampled settings: no sampled section of their own)."""
        if raw is None:
            return cls()
        subs = {"decode": {"sampled", "devices"}, "device": {"sampled"}, "sampled": set()}[section]
        allowed = {"tree", "threshold", "gate", "lookup", "without_lookup"} | subs   # (without_lookup: dropped)
        if not isinstance(raw, dict) or set(raw) - allowed:
            raise ValueError(f"{where} must be a mapping of {', '.join(sorted(allowed))}")
        tree = raw.get("tree")
        if tree is not None and not isinstance(tree, (str, list)):
            raise ValueError(f"{where}'s tree must be a tree spec or a list of paths (got {tree!r})")
        lookup = _checked(raw.get("lookup", 0), "lookup", int)
        sampled, devices = raw.get("sampled"), raw.get("devices") or {}
        if not isinstance(devices, dict) or not all(is_device_type(k) for k in devices):
            raise ValueError(f"{where}'s devices must map device types other than {HOME_DEVICE!r} (e.g. \"cuda\") "
                             f"to decode settings (got {devices!r})")
        return cls(tree=tree, threshold=_checked(raw.get("threshold", 0.0), "threshold", float),
                   gate=_checked(raw.get("gate", 0.0), "gate", float), lookup=lookup,
                   sampled=None if sampled is None else cls.from_json(sampled, section="sampled", where=f"{where}'s sampled"),
                   devices=tuple((kind, cls.from_json(devices[kind], section="device", where=f"{where}'s {kind} settings"))
                                 for kind in sorted(devices)))

    def to_json(self) -> dict:
        return self.json_of(asdict(self))

    @staticmethod
    def json_of(raw: dict) -> dict:
        """``asdict``'s form -> config.json's: unset sub-sections (``sampled``, ``devices``) left out, devices
        as a mapping."""
        out = {k: v for k, v in raw.items() if k not in ("sampled", "devices")}
        if raw.get("sampled") is not None:
            out["sampled"] = DecodeSettings.json_of(raw["sampled"])
        if raw.get("devices"):
            out["devices"] = {kind: DecodeSettings.json_of(sub) for kind, sub in raw["devices"]}
        return out

    def for_device(self, device_type: str) -> "DecodeSettings":
        """The settings "auto" reads on a device of this type (``torch.device.type``): its own where
        tune-tree measured some there, else the CPU's (the section's top level)."""
        for kind, settings in self.devices:
            if kind == device_type:
                return settings
        return replace(self, devices=())

    def with_device(self, device_type: str, settings: "DecodeSettings") -> "DecodeSettings":
        """These settings with ``settings`` as the ones for ``device_type`` (the CPU's: the top level); the
        other devices' kept."""
        if device_type == HOME_DEVICE:
            return replace(settings, devices=self.devices)
        others = tuple((k, s) for k, s in self.devices if k != device_type)
        return replace(self, devices=tuple(sorted(others + ((device_type, replace(settings, devices=())),),
                                                  key=lambda kv: kv[0])))

    def measured_devices(self) -> tuple[str, ...]:
        """The device types with settings of their own besides the CPU's."""
        return tuple(kind for kind, _ in self.devices)

    def with_pick(self, picked: "DecodeSettings", *, sampled: bool) -> "DecodeSettings":
        """These settings with ``picked`` as the greedy pick (or, ``sampled``, the sampled one); the other kept."""
        return replace(self, sampled=picked) if sampled else replace(picked, sampled=self.sampled, devices=self.devices)

    def for_sampling(self, sampling: bool) -> "DecodeSettings":
        """The settings "auto" reads when decoding samples (``sampled`` where tune-tree timed it) or not."""
        return self.sampled if sampling and self.sampled is not None else self


@dataclass(frozen=True)
class DrafterSettings:
    """Per-step settings of one drafter (None: it does not take that setting): in ``DRAFTER_SETTINGS``
    its defaults, from :func:`resolve_settings` the values it runs with."""

    tree: object = None
    threshold: float | None = None
    gate: float | None = None
    lookup: int | None = None


DRAFTER_SETTINGS: dict[str, DrafterSettings] = {
    "none": DrafterSettings(),
    "lookup": DrafterSettings(lookup=DEFAULT_LOOKUP),
    "medusa": DrafterSettings(tree=MEDUSA_DEFAULT, threshold=0.0, gate=0.0, lookup=0),
    "early-exit": DrafterSettings(tree=DEFAULT_CHAIN_TREE, threshold=0.0),
    "eagle": DrafterSettings(tree=DEFAULT_EAGLE_TREE, threshold=0.0, lookup=0),
    "draft-model": DrafterSettings(tree=DEFAULT_CHAIN_TREE, threshold=0.0),
}



def check_drafter_name(name: str) -> str:
    if name not in DRAFTER_SETTINGS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTER_SETTINGS)}")
    return name


SETTING_KEYS = ("tree", "threshold", "gate", "lookup")
# What each setting does, for --help (the generate flags and bench's per-method flags alike).
SETTING_HELP = {
    "tree": "auto | chain-K | chain-K-wW | a list of paths; eagle: dynamic-D-K-M (depth D, K expanded per level, "
            "M nodes verified); auto = as tuned",
    "threshold": "propose only tree nodes whose draft path probability is >= this (0 = the whole tree; auto = the "
                 "value tune-tree measured fastest). Output is unchanged",
    "gate": "propose nothing in a step whose tree the heads expect fewer than this many tokens accepted from "
            "(0 = always propose; auto = as tuned). Output is unchanged",
    "lookup": "also propose up to this many tokens copied from where the context's last tokens occurred before "
              "(0 = off; auto = as tuned). Output is unchanged",
}

# What each setting is and may be (threshold is a probability; gate a token count; lookup a token count).
_LIMITS = {"threshold": (0.0, 1.0), "gate": (0.0, float("inf")), "lookup": (0, float("inf"))}
_TAKEN_BY = {"threshold": "the medusa, early-exit, eagle and draft-model drafters", "gate": "the medusa drafter only",
             "lookup": "the medusa, eagle and lookup drafters only", "tree": "the medusa, early-exit, eagle and draft-model drafters"}


def _checked(value, key: str, kind: type):
    """A user's number for ``key``, as ``kind``, within its limits; one-line ValueError otherwise."""
    try:
        if kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            number = int(float(value))
        else:
            number = float(value)
    except (TypeError, ValueError, OverflowError):
        noun = "a whole number" if kind is int else "a number"
        raise ValueError(f"{key} must be 'auto' or {noun} (got {value!r})") from None
    low, high = _LIMITS[key]
    if not low <= number <= high or number == float("inf"):
        span = f"between {low:g} and {high:g}" if high != float("inf") else f"a finite number >= {low:g}"
        raise ValueError(f"{key} must be 'auto' or {span} (got {number:g})")
    return number


def _check_tree(drafter: str, tree) -> None:
    # Imported here: this module stays free of torch, so the CLI checks flags before loading it.
    from .core.tree import parse_dynamic_tree, parse_tree

    if drafter == "eagle":
        parse_dynamic_tree(tree)
    elif not parse_tree(tree, default=()):
        raise ValueError(f"tree {tree!r} has no nodes: use 'auto', chain-K with K >= 1, or a non-empty list of paths")


def check_settings(drafter: str, *, tree="auto", threshold="auto", gate="auto", lookup="auto") -> None:
    """Refuse, before any model loads, settings that ``drafter`` does not take or that cannot be
    parsed: a malformed tree, a threshold outside [0, 1], a negative gate or lookup."""
    check_drafter_name(drafter)
    declared = DRAFTER_SETTINGS[drafter]
    given = {"threshold": threshold, "gate": gate, "lookup": lookup}
    for key, value in given.items():
        if value in AUTO:
            continue
        if getattr(declared, key) is None and value not in (0, 0.0):
            hint = " (early exit: use threshold)" if key == "gate" and drafter == "early-exit" else ""
            raise ValueError(f"{key} applies to {_TAKEN_BY[key]}, not {drafter!r}{hint}")
        _checked(value, key, int if key == "lookup" else float)
    if tree not in AUTO and declared.tree is not None:
        _check_tree(drafter, tree)


def resolve_settings(drafter: str, decode: DecodeSettings | None = None, *, tree="auto", threshold="auto",
                     gate="auto", lookup="auto", sampling: bool = False, device: str = HOME_DEVICE) -> DrafterSettings:
    """The settings a drafter runs with: each given value, else ("auto") the heads' tuned ``decode``
    value (``decode``: None for drafters without heads; ``device``: the type of device the model runs
    on, whose own settings are read where tune-tree measured some there; ``sampling``: the ``sampled``
    settings where there are), else the drafter's default. Values are checked as in :func:`check_settings`."""
    check_settings(drafter, tree=tree, threshold=threshold, gate=gate, lookup=lookup)
    declared = DRAFTER_SETTINGS[drafter]

    def pick(key: str, value, kind: type):
        if getattr(declared, key) is None:
            return None
        if value not in AUTO:
            return _checked(value, key, kind)
        return kind(getattr(decode, key)) if decode is not None else getattr(declared, key)

    decode = decode.for_device(device).for_sampling(sampling) if decode is not None else None
    tuned_tree = decode.tree if decode is not None else None
    return DrafterSettings(
        tree=None if declared.tree is None else (tree if tree not in AUTO else (tuned_tree or declared.tree)),
        threshold=pick("threshold", threshold, float), gate=pick("gate", gate, float), lookup=pick("lookup", lookup, int))
