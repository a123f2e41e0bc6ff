"""Realistic constraints for tests and benchmarks: JSON Schemas (with one valid instance each) and regexes.

Every schema compiles with the bundled tokenizer to a few hundred automaton states at most, and its shortest
instance fits in well under 96 tokens. ``EXAMPLES[name]`` validates against ``SCHEMAS[name]`` and lists its keys in
the schema's order, so its compact JSON (``json.dumps(x, separators=(",", ":"))``) is accepted by the automaton.
``EXTENDED`` (with ``EXTENDED_EXAMPLES``) holds tool schemas that use the keywords beyond the core: recursion,
decimal steps, ``nullable``, ``patternProperties``, ``uniqueItems``, ``oneOf`` without a discriminator.
"""

from __future__ import annotations

from mercury_jax.constrain.schema import tool_call_schema

_TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_weather",
      "description": "Current weather at a place.",
      "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"],
        "additionalProperties": False,
      },
    },
  },
  {
    "type": "function",
    "function": {
      "name": "search_docs",
      "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"],
      },
    },
  },
]

SCHEMAS: dict[str, dict] = {
  "person": {
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 24},
      "age": {"type": "integer", "minimum": 0, "maximum": 130},
      "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
  },
  "address": {
    "type": "object",
    "properties": {
      "street": {"type": "string"},
      "city": {"type": "string"},
      "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
      "country": {"enum": ["US", "CA", "MX"]},
    },
    "required": ["street", "city", "postal_code", "country"],
  },
  "product": {
    "type": "object",
    "properties": {
      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
      "title": {"type": "string"},
      "price": {"type": "number", "minimum": 0},
      "in_stock": {"type": "boolean"},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["sku", "title", "price", "in_stock"],
  },
  "event": {
    "type": "object",
    "properties": {
      "title": {"type": "string"},
      "date": {"type": "string", "format": "date"},
      "start": {"type": "string", "format": "time"},
      "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
    },
    "required": ["title", "date", "attendees"],
  },
  "weather": {
    "type": "object",
    "properties": {
      "city": {"type": "string"},
      "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
      "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
      "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "temperature_c", "conditions", "humidity"],
  },
  "geo_point": {
    "type": "object",
    "properties": {
      "lat": {"type": "number", "minimum": -90, "maximum": 90},
      "lon": {"type": "number", "minimum": -180, "maximum": 180},
    },
    "required": ["lat", "lon"],
    "additionalProperties": False,
  },
  "rgb_color": {
    "type": "object",
    "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
    "required": ["r", "g", "b"],
  },
  "todo_list": {
    "type": "object",
    "properties": {
      "items": {
        "type": "array",
        "items": {
          "type": "object",
          "properties": {
            "id": {"type": "integer", "minimum": 1},
            "task": {"type": "string"},
            "done": {"type": "boolean"},
          },
          "required": ["id", "task", "done"],
        },
        "minItems": 1,
        "maxItems": 3,
      }
    },
    "required": ["items"],
  },
  "sentiment": {
    "type": "object",
    "properties": {
      "label": {"enum": ["positive", "negative", "neutral"]},
      "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["label", "score"],
  },
  "classification": {
    "type": "object",
    "properties": {
      "category": {"type": "string", "enum": ["bug", "feature", "question", "docs"]},
      "confidence": {"type": "number", "minimum": 0, "maximum": 1},
      "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["category", "confidence"],
  },
  "tool_call": tool_call_schema(_TOOLS),
  "shipping_label": {
    "type": "object",
    "properties": {
      "customer_shipping_address_line": {"type": "string"},
      "customer_shipping_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
      "customer_billing_country_code": {"enum": ["US", "CA"]},
      "package_weight_in_kilograms": {"type": "integer", "minimum": 1, "maximum": 70},
    },
    "required": [
      "customer_shipping_address_line",
      "customer_shipping_postal_code",
      "customer_billing_country_code",
      "package_weight_in_kilograms",
    ],
    "additionalProperties": False,
  },
  "invoice": {
    "type": "object",
    "properties": {
      "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
      "issue_date": {"type": "string", "format": "date"},
      "customer": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
        "required": ["name"],
      },
      "line_items": {
        "type": "array",
        "items": {
          "type": "object",
          "properties": {
            "description": {"type": "string"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "unit_price": {"type": "number", "minimum": 0},
          },
          "required": ["description", "quantity", "unit_price"],
        },
        "minItems": 1,
        "maxItems": 5,
      },
      "currency": {"enum": ["USD", "EUR", "GBP"]},
      "total": {"type": "number", "minimum": 0},
      "paid": {"type": "boolean"},
    },
    "required": ["invoice_number", "issue_date", "customer", "line_items", "total"],
  },
  "contact": {
    "type": "object",
    "properties": {
      "name": {"type": "string"},
      "reach": {
        "anyOf": [
          {"type": "string", "format": "email"},
          {"type": "string", "pattern": "^\\+[0-9]{7,12}$"},
        ]
      },
    },
    "required": ["name", "reach"],
  },
  "nullable_fields": {
    "type": "object",
    "properties": {
      "first_name": {"type": "string"},
      "middle_name": {"type": ["string", "null"], "maxLength": 12},
      "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 120},
    },
    "required": ["first_name", "middle_name", "age"],
  },
  "nested_config": {
    "type": "object",
    "properties": {
      "server": {
        "type": "object",
        "properties": {
          "host": {"type": "string"},
          "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        },
        "required": ["host", "port"],
      },
      "debug": {"type": "boolean"},
      "log_level": {"enum": ["debug", "info", "warning", "error"]},
    },
    "required": ["server", "debug", "log_level"],
  },
  "matrix": {
    "type": "array",
    "items": {
      "type": "array",
      "items": {"type": "integer", "minimum": 0, "maximum": 9},
      "minItems": 2,
      "maxItems": 3,
    },
    "minItems": 2,
    "maxItems": 3,
  },
  "recipe": {
    "type": "object",
    "properties": {
      "name": {"type": "string"},
      "servings": {"type": "integer", "minimum": 1, "maximum": 12},
      "ingredients": {
        "type": "array",
        "items": {
          "type": "object",
          "properties": {"item": {"type": "string"}, "grams": {"type": "number", "minimum": 0}},
          "required": ["item", "grams"],
        },
        "minItems": 1,
        "maxItems": 4,
      },
      "vegetarian": {"type": "boolean"},
    },
    "required": ["name", "servings", "ingredients"],
  },
  "book": {
    "type": "object",
    "properties": {
      "title": {"type": "string"},
      "authors": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
      "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
      "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
    },
    "required": ["title", "authors", "year"],
  },
  "flight": {
    "type": "object",
    "properties": {
      "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
      "departure": {"type": "string", "format": "date-time"},
      "seats": {"type": "integer", "minimum": 1, "maximum": 9},
      "cabin": {"enum": ["economy", "business", "first"]},
    },
    "required": ["flight_number", "departure", "seats", "cabin"],
  },
  "shape": {
    "oneOf": [
      {
        "type": "object",
        "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}},
        "required": ["kind", "radius"],
      },
      {
        "type": "object",
        "properties": {
          "kind": {"const": "rectangle"},
          "width": {"type": "number", "exclusiveMinimum": 0},
          "height": {"type": "number", "exclusiveMinimum": 0},
        },
        "required": ["kind", "width", "height"],
      },
    ]
  },
  "server_status": {
    "type": "object",
    "properties": {
      "status": {"enum": ["ok", "degraded", "down"]},
      "uptime_s": {"type": "integer", "minimum": 0},
      "services": {"type": "object", "additionalProperties": {"type": "boolean"}},
    },
    "required": ["status", "uptime_s", "services"],
  },
  "order_totals": {
    "$defs": {"money": {"type": "number", "minimum": 0, "maximum": 100000}},
    "type": "object",
    "properties": {
      "subtotal": {"$ref": "#/$defs/money"},
      "tax": {"$ref": "#/$defs/money"},
      "discount_code": {"type": "string", "pattern": "^[A-Z0-9]{4,8}$"},
    },
    "required": ["subtotal", "tax"],
  },
  "search_filters": {
    "type": "object",
    "properties": {
      "query": {"type": "string"},
      "min_price": {"type": "integer", "minimum": 0},
      "max_price": {"type": "integer", "minimum": 0},
      "in_stock_only": {"type": "boolean"},
    },
  },
  "record_ids": {
    "type": "object",
    "properties": {
      "id": {"type": "string", "format": "uuid"},
      "created_at": {"type": "string", "format": "date-time"},
      "source_ip": {"type": "string", "format": "ipv4"},
      "homepage": {"type": "string", "format": "uri"},
    },
    "required": ["id", "created_at"],
  },
}

EXAMPLES: dict[str, object] = {
  "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
  "address": {"street": "1 Main St", "city": "Springfield", "postal_code": "12345", "country": "US"},
  "product": {"sku": "ABC-1234", "title": "Desk lamp", "price": 19.99, "in_stock": True, "tags": ["home", "light"]},
  "event": {"title": "Launch", "date": "2024-02-29", "start": "09:30:00Z", "attendees": ["Ann", "Bob"]},
  "weather": {"city": "Oslo", "temperature_c": -3.5, "conditions": "snow", "humidity": 81},
  "geo_point": {"lat": 59.91, "lon": 10.75},
  "rgb_color": {"r": 255, "g": 128, "b": 0},
  "todo_list": {"items": [{"id": 1, "task": "write tests", "done": False}, {"id": 2, "task": "ship", "done": True}]},
  "sentiment": {"label": "positive", "score": 0.92},
  "classification": {"category": "bug", "confidence": 0.8, "reasons": ["crash on start"]},
  "tool_call": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
  "shipping_label": {
    "customer_shipping_address_line": "221B Baker Street",
    "customer_shipping_postal_code": "90210",
    "customer_billing_country_code": "US",
    "package_weight_in_kilograms": 12,
  },
  "invoice": {
    "invoice_number": "INV-000042",
    "issue_date": "2024-05-01",
    "customer": {"name": "Acme Corp", "email": "billing@acme.com"},
    "line_items": [
      {"description": "Widget", "quantity": 3, "unit_price": 2.5},
      {"description": "Gadget", "quantity": 1, "unit_price": 10},
    ],
    "currency": "EUR",
    "total": 17.5,
    "paid": False,
  },
  "contact": {"name": "Grace", "reach": "+4712345678"},
  "nullable_fields": {"first_name": "Alan", "middle_name": None, "age": 41},
  "nested_config": {"server": {"host": "localhost", "port": 8080}, "debug": False, "log_level": "info"},
  "matrix": [[1, 2], [3, 4, 5]],
  "recipe": {"name": "Pancakes", "servings": 4, "ingredients": [{"item": "flour", "grams": 200}], "vegetarian": True},
  "book": {"title": "Dune", "authors": ["Frank Herbert"], "year": 1965, "isbn": "9780441013593"},
  "flight": {"flight_number": "LH4012", "departure": "2025-07-14T06:45:00+02:00", "seats": 2, "cabin": "economy"},
  "shape": {"kind": "rectangle", "width": 3, "height": 4.5},
  "server_status": {"status": "degraded", "uptime_s": 86400, "services": {"db": True, "cache": False}},
  "order_totals": {"subtotal": 120.5, "tax": 24.1, "discount_code": "SAVE10"},
  "search_filters": {"query": "laptop", "max_price": 1500, "in_stock_only": True},
  "record_ids": {
    "id": "123e4567-e89b-12d3-a456-426614174000",
    "created_at": "2024-01-15T10:30:00Z",
    "homepage": "https://example.com/about",
  },
}

REGEXES: dict[str, str] = {
  "iso_date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
  "us_phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
  "identifier": r"[A-Za-z_][A-Za-z0-9_]{0,15}",
  "arithmetic": r"[0-9]{1,3}( [-+*/] [0-9]{1,3}){1,3}",
  "email": r"[a-z0-9._]{1,16}@[a-z0-9]{1,12}\.(com|org|net)",
  "hex_color": r"#[0-9a-fA-F]{6}",
  "semver": r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})",
  "time_24h": r"([01][0-9]|2[0-3]):[0-5][0-9]",
  "yes_no": r"(yes|no)",
  "python_call": r"[a-z_]{1,12}\(([0-9]{1,4}(, [0-9]{1,4}){0,2})?\)",
}

# Tool schemas as they come in the wild, using JSON Schema beyond the core (mercury_jax.constrain.schema's module
# docstring): recursive $ref, decimal bounds and steps, OpenAPI's nullable, patternProperties, uniqueItems and oneOf
# told apart by required properties. Kept apart from SCHEMAS, which tests validate with plain jsonschema: it reads
# nullable as an unknown keyword and multipleOf 0.01 in binary floats. Each fits the server's default capacity
# (512 states, 256 classes, 16384 edges).
EXTENDED: dict[str, dict] = {
  "search_filter": {
    "$defs": {
      "condition": {
        "type": "object",
        "properties": {
          "field": {"type": "string", "maxLength": 32},
          "op": {"enum": ["eq", "ne", "lt", "gt", "contains"]},
          "value": {"type": ["string", "number", "boolean"]},
        },
        "required": ["field", "op", "value"],
        "additionalProperties": False,
      },
      "filter": {
        "anyOf": [
          {"$ref": "#/$defs/condition"},
          {
            "type": "object",
            "properties": {"all": {"type": "array", "items": {"$ref": "#/$defs/filter"}, "minItems": 1}},
            "required": ["all"],
            "additionalProperties": False,
          },
          {
            "type": "object",
            "properties": {"any": {"type": "array", "items": {"$ref": "#/$defs/filter"}, "minItems": 1}},
            "required": ["any"],
            "additionalProperties": False,
          },
        ]
      },
    },
    "type": "object",
    "properties": {
      "collection": {"enum": ["orders", "customers"]},
      "filter": {"$ref": "#/$defs/filter"},
      "limit": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    "required": ["collection", "filter"],
  },
  "document_outline": {
    "$defs": {
      "section": {
        "type": "object",
        "properties": {
          "title": {"type": "string", "maxLength": 40},
          "sections": {"type": "array", "items": {"$ref": "#/$defs/section"}},
        },
        "required": ["title"],
      }
    },
    "type": "object",
    "properties": {"title": {"type": "string"}, "sections": {"type": "array", "items": {"$ref": "#/$defs/section"}}},
    "required": ["title", "sections"],
  },
  "pet": {
    "type": "object",
    "properties": {
      "id": {"type": "integer", "minimum": 1},
      "name": {"type": "string", "minLength": 1, "maxLength": 30},
      "tag": {"type": "string", "nullable": True},
      "price": {"type": "number", "minimum": 0.01, "maximum": 9999.99, "multipleOf": 0.01},
      "weight_kg": {"type": "number", "exclusiveMinimum": 0, "maximum": 120.5, "nullable": True},
    },
    "required": ["id", "name", "tag", "price"],
  },
  "http_request": {
    "type": "object",
    "properties": {
      "method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
      "url": {"type": "string", "format": "uri"},
      "headers": {
        "type": "object",
        "patternProperties": {"^[A-Za-z][A-Za-z0-9-]*$": {"type": "string"}},
        "additionalProperties": False,
      },
    },
    "required": ["method", "url"],
  },
  "share_document": {
    "type": "object",
    "properties": {
      "document_id": {"type": "string", "format": "uuid"},
      "permissions": {
        "type": "array",
        "items": {"enum": ["read", "comment", "edit", "share", "delete"]},
        "uniqueItems": True,
        "minItems": 1,
      },
      "notify": {"type": "boolean"},
    },
    "required": ["document_id", "permissions"],
  },
  "payment_method": {
    "oneOf": [
      {
        "type": "object",
        "properties": {
          "card_number": {"type": "string", "pattern": "^[0-9]{16}$"},
          "expiry": {"type": "string", "pattern": "^(0[1-9]|1[0-2])/[0-9]{2}$"},
        },
        "required": ["card_number", "expiry"],
        "additionalProperties": False,
      },
      {
        "type": "object",
        "properties": {"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}, "holder": {}},
        "required": ["iban", "holder"],
      },
    ]
  },
  "thermostat": {
    "type": "object",
    "properties": {
      "room": {"type": "string"},
      "setpoint_c": {"type": "number", "minimum": 15.5, "maximum": 30, "multipleOf": 0.5},
      "humidity": {"type": "number", "minimum": 0.3, "maximum": 0.65},
      "mode": {"enum": ["heat", "cool", "auto"]},
    },
    "required": ["room", "setpoint_c", "mode"],
  },
}

EXTENDED_EXAMPLES: dict[str, object] = {
  "search_filter": {
    "collection": "orders",
    "filter": {"all": [{"field": "status", "op": "eq", "value": "open"}, {"field": "total", "op": "gt", "value": 100}]},
    "limit": 10,
  },
  "document_outline": {
    "title": "Guide",
    "sections": [{"title": "Install", "sections": [{"title": "Linux"}]}, {"title": "Use"}],
  },
  "pet": {"id": 7, "name": "Rex", "tag": None, "price": 12.5, "weight_kg": 30.25},
  "http_request": {
    "method": "GET",
    "url": "https://example.com/api",
    "headers": {"Accept": "application/json", "X-Request-Id": "42"},
  },
  "share_document": {
    "document_id": "123e4567-e89b-12d3-a456-426614174000",
    "permissions": ["read", "comment"],
    "notify": False,
  },
  "payment_method": {"iban": "DE44500105175407324931", "holder": "Ada Lovelace"},
  "thermostat": {"room": "kitchen", "setpoint_c": 21.5, "humidity": 0.45, "mode": "heat"},
}
