"""The Twinkle server: HTTP routers over a service layer, a fair scheduler and one shared ``MultiLoraModel``.

Kept import-light on purpose: ``twinkle server add-user`` and ``check-config``
load only the config, store and auth modules, never FastAPI or torch.
"""
