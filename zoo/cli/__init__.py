"""Every command's parse-and-run: ``launch/*.py`` and ``finetune/*.py`` are shims calling ``main`` here.

Each module parses its flags with the standard library only (``--help`` loads neither torch nor DeepSpeed)
and imports the library it runs after parsing; :mod:`zoo.cli.command` ends every command the same way.
"""
