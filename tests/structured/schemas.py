"""Schemas the structured-output tests share (imported by name: pytest puts this folder on sys.path)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "maxItems": 2,
                   "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                                              "v": {"type": "integer", "minimum": -9, "maximum": 99}},
                             "required": ["k", "v"], "additionalProperties": False}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}]
