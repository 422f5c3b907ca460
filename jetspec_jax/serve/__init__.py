"""The OpenAI-compatible HTTP server: request models (`protocol`), the continuous-batching
engine over the decoding loops (`engine`), the routes (`app`) and Prometheus metrics
(`metrics`). `jetspec serve` starts it."""

MAX_BODY_BYTES = 1 << 20  # a request body's size at most, by default (1 MiB)
API_KEY_VARIABLE = "JETSPEC_API_KEY"  # where `jetspec serve` reads its API key when not given
