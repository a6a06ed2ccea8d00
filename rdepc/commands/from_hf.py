"""``rdepc from-hf``: the .rdep spec of a transformers model's MoE blocks, from its config alone
(a checkpoint directory or its config.json), offline: the model is built on the meta device,
so that no weight is read, downloaded or allocated, and :func:`rdepc.hf.spec_for` reads its
blocks."""

from __future__ import annotations

from pathlib import Path

from rdepc.api import UsageError

NEEDS = "rdepc from-hf needs transformers, which is not installed: pip install 'transformers>=5.0'"


def _config(path: Path):
    import transformers

    if not path.exists():
        raise UsageError(f"{path}: no such file or directory (a model directory or its config.json)")
    where = path if path.is_dir() else path.parent
    if path.is_file() and path.name != "config.json":
        raise UsageError(f"{path}: give a model directory or its config.json")
    if not (where / "config.json").is_file():
        raise UsageError(f"{where} has no config.json")
    try:
        return transformers.AutoConfig.from_pretrained(where, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, a malformed file
        raise UsageError(f"{where / 'config.json'}: transformers cannot read it: {e}") from None


def _model(config):
    """The model of ``config`` on the meta device, in the config's dtype."""
    import torch
    import transformers

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    errors = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config, dtype=dtype or torch.float32)
        except ValueError as e:  # no model of this kind for the config: try the next
            errors.append(str(e).splitlines()[0])
    raise UsageError(f"transformers builds no model for model_type '{config.model_type}': {'; '.join(errors)}")


def cmd_from_hf(args) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError(NEEDS) from None
    from rdepc.hf import spec_for

    text = spec_for(_model(_config(Path(args.model))), ranks=args.ranks, tokens=args.tokens)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
