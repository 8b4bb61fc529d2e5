"""transformers' checkpoint directories: config.json and safetensors shards, read and written per rank slice. It
sits below :mod:`zoo.models`, whose ``from_pretrained`` / ``save_pretrained`` use it; a family's config checks
stay with the family."""
