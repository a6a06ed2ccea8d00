"""The ``rdepc`` commands, one module each: ``check``, ``compile``, ``run``, ``tune``,
``plan``, ``viz`` and ``cache``. Each holds its ``cmd_*`` function (``args`` in, exit
status out); ``rdepc.cli`` builds the argument parser and dispatches to them, and
:mod:`rdepc.commands.common` holds what several share. Importing a command module imports
neither torch nor triton: the commands that need them import them when they run.
"""
