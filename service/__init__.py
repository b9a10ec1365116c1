"""voxcpm-serve HTTP service (FastAPI). The application itself arrives with the HTTP service issue;
this package is where its routers, schemas, settings and lifespan will live."""
