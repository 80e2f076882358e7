import sys

if sys.argv[1:2] == ["launch"]:
    # Before anything else is imported: a Ctrl-C or SIGTERM during start-up must stop the
    # launch like one that comes later, never be lost (commopt.commands.signals).
    from commopt.commands.signals import install_signal_handlers

    install_signal_handlers()

from commopt.cli import entry

entry()
