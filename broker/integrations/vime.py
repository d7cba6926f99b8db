"""A vime custom generate function that rolls out on the fleet instead of a vLLM router.

Point vime's ``--custom-generate-function-path`` at ``broker.integrations.vime.generate``. It runs
the multi-turn driver (``broker.rollouts.multiturn``) with the environment module named by
``args.rollout_interaction_env_path`` (a module path or a ``.py`` file exposing
``build_env(sample=, args=)``) and fills the vime ``Sample`` in place.

Fleet settings come from ``args`` attributes, all optional:

- ``fleet_redis_url`` (default ``redis://127.0.0.1:6379/0``), ``fleet_prefix`` (``rf``),
  ``fleet_cell`` (``0``): one FleetClient per (url, prefix, cell) and event loop, reused;
- ``fleet_model`` (default vime's ``hf_checkpoint``, the name vime's own router is asked for),
  ``fleet_step_timeout`` (seconds, none by default),
  ``fleet_max_staleness`` (the sessions' ``max_staleness``, none by default: a sample that runs
  past it comes back ``aborted``, docs/async_rl.md),
  ``fleet_tokenizer`` (an HF-like tokenizer object; default: loaded from ``hf_checkpoint`` with
  transformers' ``AutoTokenizer``, local files only, as vime loads it). The byte-level reference
  tokenizer is used only when ``fleet_model`` is ``reference-lm`` and no checkpoint is given; with
  neither a tokenizer source nor a model the call is refused;
- for prompts with images (``sample.multimodal_inputs["images"]``): ``fleet_render_url`` (a vLLM
  server of the policy; default vime's router at ``vllm_router_ip``:``vllm_router_port``) and
  ``fleet_render_model`` (default ``hf_checkpoint``). The prompt is rendered there
  (``broker.rollouts.render``), its features go with the first step, and ``sample.multimodal_train_inputs``
  is filled from them (decoded with vLLM's own serializer, so vLLM must be importable).

``generate_group(args, samples, sampling_params)`` rolls out a group of samples of one prompt (the
``n_samples_per_prompt`` samples vime hands a group hook, or a custom rollout function's group) as
one forked group (``broker.rollouts.groups``): the prompt runs once and the branches share its
prefix on one worker. ``fleet_group_needed`` (none by default) over-samples: once that many samples
of the group finished, the rest are cancelled and come back ``aborted`` (``metadata["cancelled"]``).
``fleet_seed`` (none by default: a fresh seed per group) seeds the group; sample ``i`` samples with
``fleet_seed + i * max_turns``.

vime's own ``max_turns``, ``rollout_max_context_len``, ``apply_chat_template_kwargs``,
``append_eos_token_after_stop_str_in_multi_turn`` and ``use_rollout_routing_replay`` (with
``num_layers`` / ``moe_router_topk`` checked against the routed experts) apply as in vime.
The filled sample is length-checked (``check_sample``) before it is returned.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import sys
import weakref
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from broker.client import DEFAULT_URL, FleetClient
from broker.integrations.vime_sample import check_sample
from broker.rollouts.chat_tokens import ChatTokenizer
from broker.rollouts.groups import run_multiturn_group
from broker.rollouts.multiturn import MultiTurnConfig, RolloutSample, run_multiturn
from broker.rollouts.render import ServerRenderer, has_images
from schemas.reference_tokenizer import ReferenceTokenizer

DEFAULT_MODEL = "reference-lm"
_FleetKey = tuple[str, str, str]
_FLEETS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_FleetKey, asyncio.Task[FleetClient]]] = (
    weakref.WeakKeyDictionary())


async def fleet_for(url: str = DEFAULT_URL, prefix: str = "rf", cell: str = "0") -> FleetClient:
    """The connected FleetClient of (url, prefix, cell) on the running loop, created once."""
    loop = asyncio.get_running_loop()
    clients = _FLEETS.setdefault(loop, {})
    key = (url, prefix, cell)
    task = clients.get(key)
    if task is None:
        task = loop.create_task(_connect(url, prefix, cell))
        clients[key] = task
    try:
        return await asyncio.shield(task)
    except Exception:
        if clients.get(key) is task and task.done():
            del clients[key]  # a failed connect is retried by the next call
        raise


async def _connect(url: str, prefix: str, cell: str) -> FleetClient:
    client = FleetClient(url, prefix=prefix, cell=cell)
    await client.connect()
    return client


async def close_fleets() -> None:
    """Close the clients ``fleet_for`` made on the running loop (call at shutdown)."""
    clients = _FLEETS.pop(asyncio.get_running_loop(), {})
    for task in clients.values():
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result().aclose()
        else:
            task.cancel()


def load_env_module(target: str) -> ModuleType:
    """A module by import path, or a ``.py`` file by filesystem path."""
    path = Path(target)
    if path.suffix != ".py" or not path.exists():
        return importlib.import_module(target)
    spec = importlib.util.spec_from_file_location(f"rollout_env_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import an environment module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _check_request(args: Any, sample: Any) -> None:
    if getattr(args, "partial_rollout", False):
        raise ValueError("partial rollout is not supported for interaction rollouts")
    pending = type(sample).Status.PENDING
    if sample.status != pending:
        raise ValueError(f"the fleet rollout needs a pending sample, got {sample.status}")
    if sample.response or sample.response_length or sample.loss_mask or sample.rollout_log_probs:
        raise ValueError("the fleet rollout does not accept a sample with a response already")
    if not getattr(args, "rollout_interaction_env_path", None):
        raise ValueError("args.rollout_interaction_env_path must name the environment module")


def _images(sample: Any) -> list[Any]:
    return list((getattr(sample, "multimodal_inputs", None) or {}).get("images") or [])


def _messages(sample: Any) -> list[dict[str, Any]]:
    if isinstance(sample.prompt, list):
        return [dict(message) for message in sample.prompt]
    text = str(sample.prompt).replace("<image>", "").lstrip()
    images = _images(sample)
    if not images:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [*({"type": "image", "image": image} for image in images),
                                         {"type": "text", "text": text}]}]


def _render_target(args: Any) -> tuple[str, str]:
    """(server URL, model) that renders prompts with images."""
    url = getattr(args, "fleet_render_url", None)
    if not url and getattr(args, "vllm_router_ip", None) and getattr(args, "vllm_router_port", None):
        url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
    model = getattr(args, "fleet_render_model", None) or getattr(args, "hf_checkpoint", None)
    if not url or not model:
        raise ValueError("a prompt with images is rendered by a vLLM server: set args.fleet_render_url "
                         "and args.fleet_render_model (or hf_checkpoint)")
    return str(url), str(model)


def train_inputs_from_features(features: dict[str, Any] | None) -> dict[str, Any] | None:
    """The processor outputs of a rendered prompt's images (``pixel_values``, ...) as the model
    takes them for all images at once, batched the way vLLM batches them for that model: what the
    trainer feeds the model next to ``sample.tokens``."""
    encoded = (features or {}).get("kwargs_data") or {}
    if not encoded.get("image"):
        return None
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
    from vllm.multimodal.inputs import MultiModalKwargsItems

    items = MultiModalKwargsItems({"image": [decode_mm_kwargs_item(item) for item in encoded["image"]]})
    return dict(items.get_data())


def model_name(args: Any) -> str:
    """The fleet model of a rollout: ``fleet_model``, else ``hf_checkpoint`` (what vime names its
    router's model); refused when neither is given, so no rollout silently lands on the reference LM."""
    model = getattr(args, "fleet_model", None) or getattr(args, "hf_checkpoint", None)
    if not model:
        raise ValueError("no model to roll out: set args.fleet_model (or args.hf_checkpoint, the policy "
                         f"checkpoint whose tokenizer is loaded too; {DEFAULT_MODEL!r} for the reference LM)")
    return str(model)


@lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> Any:
    # Imported here: transformers is only needed by vime users (the ``vime`` extra).
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError("loading the tokenizer of args.hf_checkpoint needs transformers: "
                         "install rollout-fleet[vime]") from exc
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from args.hf_checkpoint={path!r} (local files only): {exc}") from exc


def tokenizer_for(args: Any, model: str) -> ChatTokenizer:
    """``fleet_tokenizer`` if set, else the tokenizer of ``hf_checkpoint``, else the reference
    tokenizer when (and only when) the reference model is asked for."""
    tokenizer: ChatTokenizer | None = getattr(args, "fleet_tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    checkpoint = getattr(args, "hf_checkpoint", None)
    if checkpoint:
        loaded: ChatTokenizer = _load_tokenizer(str(checkpoint))
        return loaded
    if model == DEFAULT_MODEL:
        return ReferenceTokenizer()
    raise ValueError(f"no tokenizer for model {model!r}: set args.hf_checkpoint (a local checkpoint "
                     "directory) or args.fleet_tokenizer")


def _config(args: Any, sample: Any, sampling_params: dict[str, Any], model: str) -> MultiTurnConfig:
    return MultiTurnConfig.from_sampling_params(
        sampling_params,
        model=model,
        max_turns=args.max_turns,
        context_limit=getattr(args, "rollout_max_context_len", None),
        append_eos_after_stop=getattr(args, "append_eos_token_after_stop_str_in_multi_turn", True),
        return_routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)),
        tools=sample.metadata.get("tools"),
        chat_template_kwargs=dict(getattr(args, "apply_chat_template_kwargs", None) or {}),
        step_timeout=getattr(args, "fleet_step_timeout", None),
        max_staleness=getattr(args, "fleet_max_staleness", None),
    )


def _fill(args: Any, sample: Any, result: RolloutSample) -> Any:
    sample.tokens = result.tokens
    sample.response = result.response
    sample.response_length = result.response_length
    sample.loss_mask = result.loss_mask
    sample.rollout_log_probs = result.rollout_log_probs
    sample.status = type(sample).Status(result.status.value)
    # vime's shape: one str per generated token (RolloutSample.weight_versions), after any it had.
    sample.weight_versions = [*(sample.weight_versions or []), *(str(v) for v in result.weight_versions)]
    sample.metadata.update(result.metadata)
    experts = result.routed_experts
    if experts is not None:
        expected = (getattr(args, "num_layers", experts.shape[1]), getattr(args, "moe_router_topk", experts.shape[2]))
        if tuple(experts.shape[1:]) != tuple(expected):
            raise ValueError(f"routed experts are {experts.shape[1:]} per token; args expect {expected}")
        sample.rollout_routed_experts = experts
    return sample


async def _prepare(args: Any, sample: Any,
                   sampling_params: dict[str, Any]) -> tuple[FleetClient, MultiTurnConfig, ChatTokenizer, Any]:
    """What one rollout (or one group) needs from the args: the fleet, the config, the tokenizer and
    the environment module's ``build_env``. Raises ValueError before anything is sent."""
    model = model_name(args)
    tok = tokenizer_for(args, model)
    config = _config(args, sample, sampling_params, model)
    build_env = getattr(load_env_module(args.rollout_interaction_env_path), "build_env", None)
    if not callable(build_env):
        raise ValueError("the environment module must expose a callable build_env(sample, args)")
    fleet = await fleet_for(getattr(args, "fleet_redis_url", None) or DEFAULT_URL,
                            getattr(args, "fleet_prefix", None) or "rf", str(getattr(args, "fleet_cell", None) or "0"))
    return fleet, config, tok, build_env


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """vime's custom generate signature: roll ``sample`` out on the fleet and return it filled."""
    _check_request(args, sample)
    sample.metadata = dict(sample.metadata or {})
    fleet, config, tok, build_env = await _prepare(args, sample, sampling_params)
    messages = _messages(sample)
    render_target = _render_target(args) if has_images(messages) else None
    env = build_env(sample=sample, args=args)
    if render_target is None:
        _fill(args, sample, await run_multiturn(fleet, env, messages, config, tokenizer=tok))
        return check_sample(sample)
    async with ServerRenderer(*render_target) as renderer:
        result = await run_multiturn(fleet, env, messages, config, tokenizer=tok, renderer=renderer)
    _fill(args, sample, result)
    sample.multimodal_train_inputs = train_inputs_from_features(result.multimodal_features)
    return check_sample(sample)


def _group_size(args: Any, samples: list[Any]) -> tuple[int, int | None]:
    """(n, needed) of a group; the samples must share one prompt."""
    n = len(samples)
    expected = getattr(args, "n_samples_per_prompt", None)
    if not samples or (expected is not None and n != expected):
        raise ValueError(f"a group of {n} samples; args.n_samples_per_prompt is {expected}")
    if any(sample.prompt != samples[0].prompt for sample in samples):
        raise ValueError("the samples of a group must share one prompt")
    needed = getattr(args, "fleet_group_needed", None)
    if needed is not None and (isinstance(needed, bool) or not isinstance(needed, int) or not 1 <= needed <= n):
        raise ValueError(f"args.fleet_group_needed must be an integer in [1, {n}], got {needed!r}")
    return n, needed


async def generate_group(args: Any, samples: list[Any], sampling_params: dict[str, Any]) -> list[Any]:
    """Roll a group of samples of one prompt out as one forked group and return them filled, in
    order. Sample ``i`` gets its own environment (``build_env(sample=samples[i], args=args)``)."""
    n, needed = _group_size(args, list(samples))
    for sample in samples:
        _check_request(args, sample)
    for sample in samples:  # only once every sample passed: a refused group is left as it was
        sample.metadata = dict(sample.metadata or {})
    first = samples[0]
    params = dict(sampling_params)
    if getattr(args, "fleet_seed", None) is not None:
        params["seed"] = args.fleet_seed
    fleet, config, tok, build_env = await _prepare(args, first, params)
    messages = _messages(first)
    made = iter(samples)
    run = functools.partial(run_multiturn_group, fleet, lambda: build_env(sample=next(made), args=args),
                            messages, n, config, needed=needed, tokenizer=tok)
    if not has_images(messages):
        results = await run()
    else:
        async with ServerRenderer(*_render_target(args)) as renderer:
            results = await run(renderer=renderer)
    for sample, result in zip(samples, results, strict=True):
        _fill(args, sample, result)
        if result.multimodal_features is not None:
            sample.multimodal_train_inputs = train_inputs_from_features(result.multimodal_features)
    return [check_sample(sample) for sample in samples]
