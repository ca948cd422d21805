# The image of docs/multihost.md's GKE recipes: the repository's tracked files (the build
# context is `git archive HEAD`, so no local .venv, runs or data) installed with the
# accelerator's extra: EXTRAS=cuda12,gcs for GPU node pools, tpu,gcs for TPU slices.
FROM python:3.11-slim
ARG EXTRAS=cuda12,gcs
WORKDIR /attn_jax
COPY . .
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
