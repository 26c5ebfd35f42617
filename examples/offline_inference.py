"""The offline Python API, as in vLLM's ``examples/offline_inference/torchrun_dp_example.py``.

One process (no download: the embedded default model, token-id prompts)::

    python examples/offline_inference.py

A checkpoint with a tokenizer (text prompts, and a chat turn if it has a chat template)::

    python examples/offline_inference.py --model /path/to/checkpoint

Two DP ranks with expert parallelism and Dual Batch Overlap, each rank generating for its own
share of the prompts::

    torchrun --nproc-per-node 2 examples/offline_inference.py --model /path/to/checkpoint \\
        --data-parallel-size 2 --enable-expert-parallel --enable-dbo
"""

from __future__ import annotations

import argparse

from launch import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--enable-dbo", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    llm = LLM(
        model=args.model,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_dbo=args.enable_dbo,
        # torchrun started the ranks (vLLM's name); None works too when run alone
        distributed_executor_backend="external_launcher" if args.data_parallel_size > 1 else None,
    )
    if llm.get_tokenizer() is not None:
        prompts = PROMPTS
    else:  # the embedded default model has no tokenizer: prompts are token ids
        prompts = [{"prompt_token_ids": [1, 100 + i, 200 + i, 300 + i]} for i in range(4)]
    # each DP rank passes its own share of the prompts; its results come back on it
    mine = prompts[llm.dp_rank :: llm.dp_size]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for output in llm.generate(mine, sampling_params):
        completion = output.outputs[0]
        print(
            f"DP rank {llm.dp_rank}: prompt {output.prompt or output.prompt_token_ids!r} -> "
            f"text {completion.text!r}, token ids {completion.token_ids} "
            f"({completion.finish_reason})"
        )
    if llm.get_tokenizer() is not None and llm.offline_model.chat_template is not None:
        messages = [{"role": "user", "content": "Write one sentence about the sea."}]
        reply = llm.chat(messages, sampling_params, use_tqdm=False)[0].outputs[0].text
        print(f"DP rank {llm.dp_rank}: chat reply {reply!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
