//! A small form: labelled fields that are choices, numbers or text. The Run tab's episode
//! settings and the Train tab's configuration are forms; up/down picks a field, left/right
//! changes a choice or number, Enter edits text.

/// One field's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Choice {
        options: Vec<String>,
        index: usize,
    },
    Number {
        value: f64,
        step: f64,
        min: f64,
        max: f64,
        decimals: usize,
    },
    Text(String),
}

/// A labelled field.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub key: &'static str,
    pub label: &'static str,
    pub value: Value,
}

impl Field {
    pub fn choice(key: &'static str, label: &'static str, options: &[&str], index: usize) -> Self {
        Self {
            key,
            label,
            value: Value::Choice {
                options: options.iter().map(|s| s.to_string()).collect(),
                index: index.min(options.len().saturating_sub(1)),
            },
        }
    }
    pub fn number(
        key: &'static str,
        label: &'static str,
        value: f64,
        (step, min, max): (f64, f64, f64),
        decimals: usize,
    ) -> Self {
        Self {
            key,
            label,
            value: Value::Number {
                value,
                step,
                min,
                max,
                decimals,
            },
        }
    }
    pub fn text(key: &'static str, label: &'static str, value: &str) -> Self {
        Self {
            key,
            label,
            value: Value::Text(value.to_string()),
        }
    }

    /// The value as shown.
    pub fn display(&self) -> String {
        match &self.value {
            Value::Choice { options, index } => options.get(*index).cloned().unwrap_or_default(),
            Value::Number {
                value, decimals, ..
            } => {
                if *decimals == 0 {
                    format!("{}", value.round() as i64)
                } else if value.abs() < 1e-3 && *value != 0.0 {
                    format!("{value:.0e}")
                } else {
                    format!("{value:.decimals$}")
                }
            }
            Value::Text(s) => s.clone(),
        }
    }

    /// Step a choice or number by `delta` (±1). Numbers whose step is 0 are scaled ×/÷ 3
    /// (learning rates).
    pub fn nudge(&mut self, delta: i32) {
        match &mut self.value {
            Value::Choice { options, index } => {
                let n = options.len().max(1) as i64;
                *index = ((*index as i64 + i64::from(delta)).rem_euclid(n)) as usize;
            }
            Value::Number {
                value,
                step,
                min,
                max,
                ..
            } => {
                let next = if *step == 0.0 {
                    if delta > 0 {
                        *value * 3.0
                    } else {
                        *value / 3.0
                    }
                } else {
                    *value + *step * f64::from(delta)
                };
                *value = next.clamp(*min, *max);
            }
            Value::Text(_) => {}
        }
    }
}

/// A list of fields with a cursor.
#[derive(Debug, Clone, PartialEq)]
pub struct Form {
    pub fields: Vec<Field>,
    pub cursor: usize,
}

impl Form {
    pub fn new(fields: Vec<Field>) -> Self {
        Self { fields, cursor: 0 }
    }
    pub fn up(&mut self) {
        self.cursor = self.cursor.saturating_sub(1);
    }
    pub fn down(&mut self) {
        self.cursor = (self.cursor + 1).min(self.fields.len().saturating_sub(1));
    }
    pub fn nudge(&mut self, delta: i32) {
        if let Some(f) = self.fields.get_mut(self.cursor) {
            f.nudge(delta);
        }
    }
    pub fn field(&self, key: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.key == key)
    }
    pub fn field_mut(&mut self, key: &str) -> Option<&mut Field> {
        self.fields.iter_mut().find(|f| f.key == key)
    }
    pub fn current(&self) -> Option<&Field> {
        self.fields.get(self.cursor)
    }
    /// The selected option of a choice field.
    pub fn choice(&self, key: &str) -> String {
        self.field(key).map(Field::display).unwrap_or_default()
    }
    pub fn number(&self, key: &str) -> f64 {
        match self.field(key).map(|f| &f.value) {
            Some(Value::Number { value, .. }) => *value,
            _ => 0.0,
        }
    }
    pub fn text(&self, key: &str) -> String {
        match self.field(key).map(|f| &f.value) {
            Some(Value::Text(s)) => s.clone(),
            _ => String::new(),
        }
    }
    pub fn set_text(&mut self, key: &str, s: &str) {
        if let Some(Field {
            value: Value::Text(t),
            ..
        }) = self.field_mut(key)
        {
            *t = s.to_string();
        }
    }
    /// Replace a choice field's options, keeping the selection when it still exists.
    pub fn set_options(&mut self, key: &str, new: Vec<String>) {
        if let Some(Field {
            value: Value::Choice { options, index },
            ..
        }) = self.field_mut(key)
        {
            let keep = options.get(*index).cloned();
            *index = keep
                .and_then(|k| new.iter().position(|o| *o == k))
                .unwrap_or(0);
            *options = new;
        }
    }
    pub fn select(&mut self, key: &str, option: &str) -> bool {
        if let Some(Field {
            value: Value::Choice { options, index },
            ..
        }) = self.field_mut(key)
            && let Some(i) = options.iter().position(|o| o == option)
        {
            *index = i;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_wrap_numbers_clamp_and_rates_scale() {
        let mut f = Form::new(vec![
            Field::choice("m", "mode", &["real", "rehearse", "shadow"], 0),
            Field::number("n", "N", 2.0, (1.0, 0.0, 8.0), 0),
            Field::number("lr", "lr", 1e-4, (0.0, 1e-7, 1e-2), 6),
        ]);
        f.nudge(-1);
        assert_eq!(f.choice("m"), "shadow");
        f.down();
        for _ in 0..20 {
            f.nudge(1);
        }
        assert_eq!(f.number("n"), 8.0);
        f.down();
        f.nudge(1);
        assert!((f.number("lr") - 3e-4).abs() < 1e-12);
        f.set_options("m", vec!["shadow".into(), "real".into()]);
        assert_eq!(f.choice("m"), "shadow");
    }
}
