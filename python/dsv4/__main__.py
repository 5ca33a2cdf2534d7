"""python3 -m dsv4 import sglang|miles ...: the import of `dsv4 import`, which also reads miles' .pt
rollout dumps (pickles, read by dsv4.torch_pickle without running their code).

Exit codes as the dsv4 command's: 0 success, 2 bad input (the message names the file, request, layer
and row), 1 any other failure.
"""

import argparse
import sys

from ._dsv4 import Error, InputError
from .adapters import main_import


def _parser():
    p = argparse.ArgumentParser(prog="python3 -m dsv4", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Import another engine's routing / indexer decisions (R3) as a trace")
    engines = imp.add_subparsers(dest="engine", required=True)
    for engine, inputs in (("sglang", "SGLang responses: JSON (an object or an array of them) or JSONL"),
                           ("miles", "miles rollout dumps (.pt), or .npz files and sample directories")):
        e = engines.add_parser(engine, help="Import {} R3 data as one external step".format(engine),
                               epilog="Layouts, fields read and the checks: docs/ADAPTERS.md")
        e.add_argument("inputs", nargs="+", metavar="INPUTS", help=inputs)
        model = e.add_mutually_exclusive_group(required=True)
        model.add_argument("--config", help="The model's config.json (no hash-layer check)")
        model.add_argument("--model", help="Checkpoint directory: config and weights (checks hash layers "
                                           "against tid2eid)")
        model.add_argument("--preset", help="Built-in config: tiny, tiny-b, mid, flash, pro")
        e.add_argument("--out", required=True, help="New trace file (NAME.h5)")
        e.add_argument("--kind", default="rollout", choices=("rollout", "train"),
                       help="rollout (an inference engine) or train (a trainer's forward); default rollout")
        e.add_argument("--profile", default="unknown",
                       help="The engine's numerics profile, when one of ours describes it")
        if engine == "sglang":
            e.add_argument("--prefix-memory", type=int, default=1024, metavar="MB",
                           help="MiB of earlier requests' routing kept to complete incremental buffers "
                                "(routed_experts_start_len > 0); default 1024")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return main_import(args)
    except InputError as e:
        print("dsv4: error: {}".format(e), file=sys.stderr)
        return 2
    except Error as e:
        print("dsv4: error: {}".format(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
