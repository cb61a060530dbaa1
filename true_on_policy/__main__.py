"""``python -m true_on_policy contract {list,show NAME,fingerprint NAME}``."""

from __future__ import annotations

import argparse
import json
import sys

from true_on_policy.contract import UnknownContractError, contract_status, get_contract, known_contracts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m true_on_policy")
    sub = parser.add_subparsers(dest="group", required=True)
    contract = sub.add_parser("contract", help="inspect the registered contracts")
    csub = contract.add_subparsers(dest="action", required=True)
    csub.add_parser("list", help="the registered contracts: name, status, fingerprint")
    for action in ("show", "fingerprint"):
        p = csub.add_parser(action, help=f"{action} one contract")
        p.add_argument("name")
    args = parser.parse_args(argv)
    if args.action == "list":
        for name in known_contracts():
            print(f"{name}  {contract_status(name)}  {get_contract(name).fingerprint[:12]}")
        return 0
    try:
        c = get_contract(args.name)
    except UnknownContractError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.action == "fingerprint":
        print(c.fingerprint)
    else:
        print(json.dumps({"fingerprint": c.fingerprint, "contract": c.to_dict()}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
