"""The shared routes (/aotx/v1/shared, /aotx/v1/media): their DRF views (each the device command it makes), URLs, strict parsing and the OpenAPI document."""
