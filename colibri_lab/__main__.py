"""`python -m colibri_lab inspect FILE [--verify] [--all]`,
`python -m colibri_lab convert --model_name_or_path DIR --output_path OUT [...]` and
`python -m colibri_lab quality ...`."""

import sys

USAGE = """usage: python -m colibri_lab COMMAND ...

commands:
  inspect FILE [--verify] [--all]   show and validate a .colibri file
  convert --model_name_or_path DIR --output_path OUT [--dtype ...]
                                    convert a Hugging Face Mixtral checkpoint
  quality --ref A --test B --text F | --precision-agreement FILE
                                    KL / top-1 / routing flips of a file against a
                                    reference, or of the fast numeric mode against exact
run a command with --help for its options."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "inspect":
        from .format.reader import main as inspect_main
        return inspect_main(rest)
    if cmd == "convert":
        from .conversion.cli import main as convert_main
        return convert_main(rest)
    if cmd == "quality":
        from .analysis.quality_cli import main as quality_main
        return quality_main(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
