"""The API server process (`kiln serve`'s front, `kiln router`): the OpenAI-compatible HTTP server, its request
and response models, chat rendering, tool and reasoning parsers, detokenizing, and the engine-core client it
drives. Nothing here imports torch; the layer test (tests/runtime/test_layers.py) holds it to that."""
