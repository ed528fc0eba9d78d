"""One ComponentLoader per kind of module in a model folder.

- composer models (the DiT): composer's own class from the model registry, weights via `load_weights`;
- diffusers models (the VAE) and schedulers: diffusers' own `from_pretrained`;
- transformers models (the text encoder) and tokenizers: transformers' own `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from composer._fields import json_field_problems, signature_types
from composer.errors import CheckpointError, ComposerError, ModelFormatError, UnknownModelError
from composer.loader.model_index import ComponentSpec
from composer.loader.weights import load_weights
from composer.logging import get_logger
from composer.registry.models import get_model_class, has_model_class

logger = get_logger(__name__)


class ComponentLoader:
    """Loads one component (a subfolder of the model folder) onto a device in a dtype."""

    def load(self, folder: Path, spec: ComponentSpec, device: torch.device, dtype: torch.dtype | None) -> Any:
        raise NotImplementedError

    def check_config(self, folder: Path, spec: ComponentSpec) -> None:
        """Refuse a config file whose values have the wrong JSON type (ModelFormatError naming the file, the
        component, the field, what it expects and the value), reading no weights. A missing file is left to
        `load`, which says so."""

    @staticmethod
    def for_spec(spec: ComponentSpec, folder: Path) -> ComponentLoader:
        """Pick the loader for a model_index entry."""
        class_name = _config_class_name(folder) or spec.class_name
        if has_model_class(class_name):
            return ComposerModelLoader()
        if spec.library == "diffusers":
            import diffusers

            cls = getattr(diffusers, spec.class_name, None)
            if cls is None:
                raise UnknownModelError(f"diffusers has no class '{spec.class_name}' (component '{spec.name}')")
            if issubclass(cls, diffusers.SchedulerMixin):
                return SchedulerLoader()
            return DiffusersModelLoader()
        if spec.library == "transformers":
            if "ImageProcessor" in spec.class_name:
                return ImageProcessorLoader()
            if "Tokenizer" in spec.class_name or "Processor" in spec.class_name:
                return TokenizerLoader()
            return TransformersModelLoader()
        raise UnknownModelError(
            f"component '{spec.name}' comes from library '{spec.library}' ({spec.class_name}), which composer "
            "cannot load (expected diffusers or transformers)"
        )


def read_config_file(path: Path) -> dict[str, Any]:
    """A component's config file as written: only the settings the folder states.

    diffusers and transformers fill unstated settings with their own defaults when they load a component,
    so the loaded object's `config` cannot tell what the folder said from what the library assumed.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path} does not exist; the model folder is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def check_component_configs(folder: Path, specs: list[ComponentSpec], libraries: bool = True) -> None:
    """Check the config file of every component in `specs` before any of them loads: a bad value in the last
    component's file must not cost the first component's loading time, nor surface as a library's traceback.
    `libraries=False` checks only composer's own models (no diffusers or transformers import: the CLI's fast
    check; the library components are checked again, in full, before loading)."""
    for spec in specs:
        if libraries or has_model_class(_config_class_name(folder / spec.name) or spec.class_name):
            ComponentLoader.for_spec(spec, folder / spec.name).check_config(folder / spec.name, spec)


def _check_library_config(path: Path, spec: ComponentSpec, init: Any) -> None:
    """A diffusers or transformers config file against the types of the class's `__init__` (the kind of each
    value only: these annotations are looser than what the libraries accept)."""
    if not path.is_file():
        return
    problems = json_field_problems(read_config_file(path), signature_types(init), strict=False)
    if problems:
        raise ModelFormatError(f"{path} (component '{spec.name}', {spec.class_name}): {'; '.join(problems)}")


def _config_class_name(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("_class_name")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _require_folder(folder: Path, spec: ComponentSpec) -> None:
    if not folder.is_dir():
        raise ModelFormatError(
            f"model_index.json lists component '{spec.name}' ({spec.class_name}) but {folder} does not exist"
        )


def _wrap_load_error(exc: Exception, folder: Path, spec: ComponentSpec) -> ComposerError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "safetensors" in text.lower() or "header" in text.lower() or "deserializ" in text.lower():
        return CheckpointError(f"could not read the weights of '{spec.name}' in {folder}: {text}")
    return ModelFormatError(f"could not load '{spec.name}' ({spec.class_name}) from {folder}: {text}")


class ComposerModelLoader(ComponentLoader):
    """composer's own model class (found by the model registry), built on meta, filled from safetensors."""

    def load(self, folder, spec, device, dtype):
        return self.fill(self.build(folder, spec), folder, device, dtype)

    @staticmethod
    def fill(model: torch.nn.Module, folder: Path, device: torch.device, dtype: torch.dtype | None,
             **load_kwargs: Any) -> torch.nn.Module:
        """Load every tensor of `model` (built on meta) from `folder`'s safetensors (`load_weights`, which
        `load_kwargs` go to) and return it in eval mode without gradients; a tensor left on meta is an error."""
        cls = type(model)
        scheme = load_weights(model, folder, device, dtype or torch.float32, **load_kwargs)
        leftovers = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
        if leftovers:
            raise CheckpointError(f"{cls.__name__} still has unloaded tensors after loading: {leftovers[:5]}")
        logger.debug("loaded %s from %s (%s naming)", cls.__name__, folder, scheme)
        return model.eval().requires_grad_(False)

    @staticmethod
    def model_class_and_config(folder: Path, spec: ComponentSpec) -> tuple[type[torch.nn.Module], Any]:
        """The composer model class serving `folder` (its config.json's `_class_name`, else the spec's) and its
        config object read from config.json; no weights read."""
        _require_folder(folder, spec)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ModelFormatError(f"{folder} has no config.json for component '{spec.name}'")
        raw = read_config_file(config_path)
        cls = get_model_class(raw.get("_class_name") or spec.class_name)
        return cls, cls.config_class.from_dict(raw, source=f"{config_path} (component '{spec.name}')")

    def check_config(self, folder, spec):
        if (folder / "config.json").is_file():
            self.model_class_and_config(folder, spec)

    def build(self, folder: Path, spec: ComponentSpec) -> torch.nn.Module:
        """The model of `folder` from its config.json, on the meta device (no weights read)."""
        cls, config = self.model_class_and_config(folder, spec)
        with torch.device("meta"):
            return cls(config)


class DiffusersModelLoader(ComponentLoader):
    def check_config(self, folder, spec):
        import diffusers

        _check_library_config(folder / "config.json", spec, getattr(diffusers, spec.class_name).__init__)

    def load(self, folder, spec, device, dtype):
        import diffusers

        _require_folder(folder, spec)
        cls = getattr(diffusers, spec.class_name)
        try:
            model = cls.from_pretrained(str(folder), torch_dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise _wrap_load_error(exc, folder, spec) from exc
        return model.to(device).eval().requires_grad_(False)


class TransformersModelLoader(ComponentLoader):
    def check_config(self, folder, spec):
        import transformers

        config_class = getattr(getattr(transformers, spec.class_name, None), "config_class", None)
        if config_class is not None:
            _check_library_config(folder / "config.json", spec, config_class.__init__)

    def load(self, folder, spec, device, dtype):
        import transformers

        _require_folder(folder, spec)
        cls = getattr(transformers, spec.class_name, None)
        if cls is None:
            raise UnknownModelError(f"transformers has no class '{spec.class_name}' (component '{spec.name}')")
        dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        try:
            model = cls.from_pretrained(str(folder), **{dtype_kw: dtype})
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise _wrap_load_error(exc, folder, spec) from exc
        return model.to(device).eval().requires_grad_(False)


class TokenizerLoader(ComponentLoader):
    def load(self, folder, spec, device, dtype):
        from transformers import AutoTokenizer

        _require_folder(folder, spec)
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as exc:
            raise _wrap_load_error(exc, folder, spec) from exc


class ImageProcessorLoader(ComponentLoader):
    """An image processor (I2V's CLIPImageProcessor): the class model_index.json names, as diffusers loads it."""

    def load(self, folder, spec, device, dtype):
        import transformers

        _require_folder(folder, spec)
        cls = getattr(transformers, spec.class_name, None)
        if cls is None:
            raise UnknownModelError(f"transformers has no class '{spec.class_name}' (component '{spec.name}')")
        try:
            return cls.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as exc:
            raise _wrap_load_error(exc, folder, spec) from exc


class SchedulerLoader(ComponentLoader):
    def check_config(self, folder, spec):
        import diffusers

        cls = getattr(diffusers, spec.class_name)
        _check_library_config(folder / cls.config_name, spec, cls.__init__)

    def load(self, folder, spec, device, dtype):
        import diffusers

        _require_folder(folder, spec)
        cls = getattr(diffusers, spec.class_name)
        try:
            return cls.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as exc:
            raise _wrap_load_error(exc, folder, spec) from exc
