"""Modules the vLLM server a job starts imports: this folder is put first on that server's ``PYTHONPATH``
(:func:`clemprm.models.vllm_backend.server_environment`); clemprm itself imports none of them."""
