"""`selfspec bench`'s arguments: the decode grid's flags and its subcommands (compare, quality,
serve, plot), apart from the code that runs them (`bench.py`)."""

from __future__ import annotations


def add_bench_parser(sub, add_common_args) -> None:
    # allow_abbrev off: a subcommand's flag (serve's --mode) is not read as a prefix of the grid's
    b = sub.add_parser("bench", allow_abbrev=False,
                       help="compare AR, linear and PRESTO on a prompt file (or: bench compare | quality | serve | plot)")
    add_common_args(b)
    b.add_argument("--prompts", default=None, help="JSONL prompt file (default: the model's prompts.jsonl)")
    b.add_argument("--suite", default=None, choices=["long"],
                   help="a shipped suite instead of --prompts: long = 8 prompts of ~1,000 and 8 of ~3,000 tokens "
                        "(edit code, answer with quotes, summarise, multi-turn chat; half tune, half held-out), "
                        "96 new tokens, eos off, T=0; reports time to first token and decode tok/s per length and "
                        "split (--limit N: the first N of each length)")
    b.add_argument("--full", action="store_true",
                   help="the full grid: every mode, both schedules, budgets 8 and 32, 32 prompts (tens of minutes on "
                        "the default model on 2 CPU cores)")
    b.add_argument("--modes", nargs="+", default=None,
                   help="rows: ar, auto, lookup, linear, presto, hybrid (PRESTO with context candidates); "
                        "default ar auto lookup (--full: all)")
    b.add_argument("--peers", nargs="*", default=None,
                   help="transformers generate on the checkpoint's weights: hf (greedy/sampled; default when the "
                        "weights are fp32, or with --full), hf-lookup (prompt lookup; default with --full); llama.cpp on "
                        "the original GGUF (needs llama-cpp-python; default: on when installed)")
    b.add_argument("--gguf", default=None, help="the GGUF the llama.cpp peer runs (default model: found by itself)")
    b.add_argument("--compare-weights", nargs="*", default=["fp32"],
                   help="weight formats that also run AR in the same run (default fp32; none: --compare-weights)")
    b.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0],
                   help="one row set per temperature (--temperature T runs only T)")
    b.add_argument("--schedules", nargs="+", default=None,
                   help="PRESTO / hybrid / linear rows: auto (PRESTO laid out per round as this device affords), "
                        "two-pass, one-pass (the paper's: a mask group on every node); default auto (--full: all "
                        "three; linear runs the fixed ones)")
    b.add_argument("--budgets", nargs="+", type=int, default=[8, 32])
    b.add_argument("--limit", type=int, default=None,
                   help="use the first N prompts (default 8, half code and half chat on the default model: under 5 min "
                        "on 2 CPU cores; --full: 32; --suite: all, N = the first N of each length; 0 = all)")
    b.add_argument("--out", default=None, help="output folder (default bench_out/<time>)")
    b.add_argument("--threads", type=int, default=None, help="torch threads for the run (default: torch's)")
    b.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times per prompt, in mirrored order (A B C C B A), times summed: "
                        "single runs vary on a busy machine (default 1); with "
                        "--batch-sizes, the mirrored block of each batch size (A B B A) this many times")
    b.add_argument("--control", action="store_true",
                   help="run the AR row a second time as a row of its own, 'ar (control)', interleaved like every "
                        "row, and print its ratio to AR under auto's: two identical settings, so how far this run's "
                        "noise alone moves a ratio; with --suite and --batch-sizes too")
    b.add_argument("--batch-sizes", nargs="+", type=int, default=None,
                   help="batched decoding instead: each mode (default ar auto) and transformers' batched generate "
                        "(left padding) decode the prompt set B rows at a time, for each B (default 16 prompts, T=0), each "
                        "twice in mirrored order (A B C C B A) against drift; "
                        "--profile then takes a batch cost profile")
    b.add_argument("--replay", default=None, metavar="PROFILE",
                   help="replayed acceptance: our rows' draft marginals replaced by a profile's (a built-in such as "
                        "nld-8b, or a JSON file), drawn against the AR output; T = 0; no peers unless named; prints "
                        "each row's speedup on the cost model and auto's hindsight bound (docs/replay.md)")
    from selfspec.tools.bench import cmd_bench

    b.set_defaults(func=cmd_bench, max_new_tokens=None, temperature=None)  # max_new_tokens: 64 (--suite: 96)
    add_bench_subcommands(b)


def add_bench_subcommands(b) -> None:
    """`bench compare | quality | serve | plot`: the other measurements, one command family (issue 76)."""
    from selfspec.tools.bench_compare import add_compare_parser, add_plot_parser
    from selfspec.tools.bench_quality import add_quality_parser
    from selfspec.tools.bench_serve import add_serve_bench_parser

    sub = b.add_subparsers(dest="bench_cmd", metavar="{compare,quality,serve,plot}", required=False,
                           help="another measurement instead of the decode grid (each has --help)")
    add_compare_parser(sub)
    add_quality_parser(sub)
    add_serve_bench_parser(sub)
    add_plot_parser(sub)
