"""voxcpm-serve HTTP service (FastAPI): routers per resource, pydantic schemas, settings from the
environment, a lifespan that owns the engine pool. `create_app(settings)` builds the application."""
