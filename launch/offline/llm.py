"""vLLM's offline API: ``LLM(model, ...).generate(prompts, sampling_params)`` and ``.chat``. Under
torchrun each DP rank passes its own prompts and gets its own results; ``generate`` and ``chat``
are collective, and a rank's bad input raises on every rank. The API: docs/offline.md; DP ranks:
docs/offline.md#data-parallelism-under-torchrun."""

from __future__ import annotations

import atexit

from launch.engine.output_paths import check_output_paths
from launch.engine.request import SamplingParams
from launch.offline.config import (
    OfflineModel,
    engine_args_from_kwargs,
    is_launched_by_torchrun,
    load_offline_model,
)
from launch.offline.dp import agree_on_input
from launch.offline.outputs import RequestOutput
from launch.offline.prompts import (
    ParsedPrompt,
    check_prompt_ids,
    encode_prompts,
    missing_tokenizer_error,
    parse_prompts,
)
from launch.offline.runner import OfflineRun, request_ids


class LLM:
    """An engine on this DP rank, vLLM's ``LLM``.

    Args:
        model: a Hugging Face checkpoint directory (``config.json`` + safetensors, with
            ``tokenizer.json`` for text prompts and ``tokenizer_config.json`` /
            ``chat_template.jinja`` for ``chat``), or None for the embedded default model
            (random weights, no tokenizer).
        tokenizer: a directory with ``tokenizer.json`` (default: ``model``).
        distributed_executor_backend: None or ``"external_launcher"`` (torchrun started the
            ranks); under torchrun either works.
        tensor_parallel_size: 1 only.
        **kwargs: any ``launch.engine.EngineArgs`` field by its name (vLLM's): ``dtype``
            (``"auto"``: bfloat16), ``seed``, ``max_model_len``, ``max_num_seqs``,
            ``data_parallel_size``, ``enable_expert_parallel``, ``enable_dbo``,
            ``dbo_decode_token_threshold``, ``all2all_backend``, ``enforce_eager``,
            ``profiler_config`` (a dict, as ``--profiler-config``'s JSON), ...

    Raises:
        TypeError: an unknown argument, or a value of the wrong type (naming it).
        ValueError: a value out of range, flags that contradict each other, DP > 1 without
            torchrun, a bad checkpoint (naming the value or file) — all before any process group
            exists, alike on every rank.
        OSError: a missing or unreadable checkpoint, or an output directory
            (``timeline_dir``, ``torch_profiler_dir``) that cannot be written.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        distributed_executor_backend: str | None = None,
        tensor_parallel_size: int = 1,
        **kwargs,
    ) -> None:
        args = engine_args_from_kwargs(model, kwargs)
        check_output_paths(args)
        by_torchrun = is_launched_by_torchrun(
            args, distributed_executor_backend, tensor_parallel_size
        )
        self._start(args, load_offline_model(args, tokenizer), by_torchrun)

    @classmethod
    def from_engine_args(cls, engine_args, offline_model: OfflineModel | None = None) -> LLM:
        """An ``LLM`` on checked ``EngineArgs`` (``launch.generate``); ``offline_model`` if the
        caller already loaded it. Raises as ``LLM()`` does."""
        llm = cls.__new__(cls)
        by_torchrun = is_launched_by_torchrun(engine_args, None, 1)
        offline_model = offline_model or load_offline_model(engine_args)
        llm._start(engine_args, offline_model, by_torchrun)
        return llm

    def _start(self, args, offline_model: OfflineModel, by_torchrun: bool) -> None:
        from distributed import single_process_groups
        from distributed.liveness import Heartbeat
        from launch.engine.llm_engine import LLMEngine
        from launch.engine.startup import init_engine_groups
        from moe.platforms.plugins import current_platform

        self.offline_model = offline_model
        self.heartbeat = None
        self._owns_process_groups = by_torchrun
        self._ids = request_ids()
        if by_torchrun:
            groups = init_engine_groups(args)  # the platform's distributed backend
            self.heartbeat = Heartbeat(rank=groups.rank, world_size=groups.world_size).start()
        else:
            device = current_platform().place_rank().device
            groups = single_process_groups(args.distributed_timeout_s, device)
        atexit.register(self.shutdown)
        try:
            self.llm_engine = LLMEngine(
                engine_args=args, model=offline_model.resolved, groups=groups
            )
        except BaseException:
            self.shutdown()
            raise

    @property
    def dp_rank(self) -> int:
        return self.llm_engine.groups.dp_rank

    @property
    def dp_size(self) -> int:
        return self.llm_engine.groups.dp_size

    def get_tokenizer(self):
        """The checkpoint's tokenizer (``launch.text.detokenizer.Tokenizer``), or None."""
        return self.offline_model.tokenizer

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start this rank's profiler (``profiler_config``; vLLM's ``LLM.start_profile``): the
        steps of the ``generate`` / ``chat`` calls until ``stop_profile`` are recorded, in a
        trace named ``[<profile_prefix>_]rank<r>.<ms>.pt.trace.json[.gz]``. Under torchrun every
        rank calls it, like ``generate``.

        Raises:
            RuntimeError: the LLM was built without ``profiler_config``.
            ValueError: a prefix other than letters, digits, ``_``, ``.``, ``-`` (1-64).
        """
        self.llm_engine.observability.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop this rank's profiler and write its trace (``torch_profiler_dir``); nothing when
        it is not on."""
        self.llm_engine.observability.stop_profile()

    def shutdown(self) -> None:
        """Stop the profiler (writing its trace) and the heartbeat, and destroy the process
        groups this LLM created (idempotent; also run at interpreter exit)."""
        atexit.unregister(self.shutdown)
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.observability.stop_profile()
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self._owns_process_groups:
            from distributed import destroy_distributed

            destroy_distributed()
            self._owns_process_groups = False

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for this rank's ``prompts``; one ``RequestOutput`` per prompt, in order.

        Args:
            prompts: a prompt or a list of prompts, each a string, ``{"prompt": str}`` or
                ``{"prompt_token_ids": [int, ...]}`` (a mix is fine; ``[]`` on a rank with none).
                Text is encoded with the tokenizer's special tokens (e.g. BOS), as vLLM does.
            sampling_params: a ``SamplingParams`` for every prompt, a list of one per prompt, or
                None (``SamplingParams()``: 16 greedy tokens).
            use_tqdm: a progress bar of finished sequences (on DP rank 0 only).

        Raises:
            TypeError: a prompt or a sampling parameter of the wrong type (naming its index).
            ValueError: a text prompt without a tokenizer (naming the missing file), stop
                strings without one, an empty or too long prompt, a token id outside the
                vocabulary, as many ``SamplingParams`` as prompts not given. On every DP rank
                when any rank's input is bad, before any engine step.
        """
        return self._run(lambda: self._prepare(parse_prompts(prompts), sampling_params), use_tqdm)

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of OpenAI message dicts) or to each of a
        list of conversations, rendered with the checkpoint's chat template (or
        ``chat_template``, a jinja2 source) exactly as the server's chat completions are, and
        encoded without adding special tokens. ``RequestOutput.prompt`` is the rendered text.

        Raises:
            ValueError: no tokenizer or no chat template, a malformed message (naming it), the
                template refusing the messages, or any ``generate`` error; on every DP rank.
            TypeError: as ``generate``.
        """

        def prepare():
            from launch.offline.chat import render_conversations

            rendered = render_conversations(
                self.offline_model,
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
            return self._prepare(rendered, sampling_params)

        return self._run(prepare, use_tqdm)

    def _run(self, prepare, use_tqdm: bool) -> list[RequestOutput]:
        """``prepare()`` (checks, raising ValueError/TypeError) agreed on by every DP rank, then
        the engine requests stepped until every DP rank is done."""
        error = None
        try:
            run = prepare()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it before raising
            error = e
        agree_on_input(error, self.llm_engine.groups)
        progress = None
        if use_tqdm and self.dp_rank == 0:
            from tqdm import tqdm

            progress = tqdm(total=len(run.sequences), desc="Processed prompts", unit="seq")
        try:
            return run.run(progress)
        finally:
            if progress is not None:
                progress.close()

    def _prepare(self, prompts: list[ParsedPrompt], sampling_params) -> OfflineRun:
        """The checked, encoded prompts as an ``OfflineRun`` (no engine state changes yet)."""
        params = params_per_prompt(sampling_params, len(prompts))
        offline_model = self.offline_model
        tokenizer = offline_model.tokenizer
        resolved = offline_model.resolved
        prompts = encode_prompts(
            prompts, tokenizer, offline_model.tokenizer_dir, max_model_len=resolved.max_model_len
        )
        if tokenizer is None and any(sp.stop for sp in params):
            raise missing_tokenizer_error(offline_model.tokenizer_dir, "stop strings")
        kv = self.llm_engine.kv_cache_manager
        for index, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            check_prompt_ids(
                prompt.token_ids,
                index,
                vocab_size=resolved.config.vocab_size,
                max_model_len=resolved.max_model_len,
            )
            num_tokens = min(len(prompt.token_ids) + sp.max_tokens, resolved.max_model_len)
            if kv.num_blocks_for(num_tokens) > kv.num_blocks:
                raise ValueError(
                    f"prompt {index}: {num_tokens} tokens (prompt + max_tokens) exceed the KV "
                    f"cache of a DP rank ({kv.num_blocks * kv.block_size} tokens)"
                )
        return OfflineRun(self.llm_engine, tokenizer, prompts, params, self._ids)


def params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt from ``generate``'s argument.

    Raises:
        TypeError: not a SamplingParams, a list of them or None (naming the index).
        ValueError: a list whose length is not the number of prompts.
    """
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(
            "sampling_params must be a SamplingParams, a list of one per prompt or None, got "
            f"{type(sampling_params).__name__}"
        )
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts; pass one, "
            "or one per prompt"
        )
    for index, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(
                f"sampling_params[{index}] must be a SamplingParams, got {type(sp).__name__}"
            )
    return list(sampling_params)
