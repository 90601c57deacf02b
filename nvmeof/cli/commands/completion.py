"""`nvmeof completion bash|zsh`: print the shell completion script click generates for this command line.

The script calls `nvmeof` back with ``_NVMEOF_COMPLETE=<shell>_complete`` set, and click answers with the
commands, options and choices valid at the cursor (click.shell_completion).
"""

from __future__ import annotations

import click

SHELLS = ("bash", "zsh")
COMPLETE_VAR = "_NVMEOF_COMPLETE"   # click's default for prog_name "nvmeof": _{PROG_NAME}_COMPLETE


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the SHELL completion script; load it with `eval "$(nvmeof completion bash)"` (bash) or
    `eval "$(nvmeof completion zsh)"` (zsh), e.g. from ~/.bashrc or ~/.zshrc."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    if cls is None:  # click ships bash, zsh and fish; the Choice above lets only the first two through
        raise click.UsageError(f"click has no completion for {shell!r}: use one of {', '.join(SHELLS)}")
    root = ctx.find_root().command
    click.echo(cls(root, {}, "nvmeof", COMPLETE_VAR).source())


def register(cli: click.Group) -> None:
    cli.add_command(completion)
