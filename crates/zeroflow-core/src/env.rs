//! Reading the `ZEROFLOW_*` environment variables that pick one of a few named settings
//! (attention, CPU binding, how host threads wait, the offload stream's stores and gather): one
//! reading and one matching for all of them, so that each accepts the same spellings. Only the
//! binary reads them (its `settings` module); the libraries take options.

/// The value of environment variable `name`, if it is set (converted lossily to UTF-8).
pub fn var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}

/// The setting of `choices` (name, setting) that `value` names, spaces around it and ASCII case
/// ignored: `Ok(None)` where `value` is unset or blank, `Err` with the trimmed value (for the
/// caller's message) where it names none of them.
pub fn choice<'v, T: Copy>(
    value: Option<&'v str>,
    choices: &[(&str, T)],
) -> Result<Option<T>, &'v str> {
    let value = value.map(str::trim).unwrap_or_default();
    if value.is_empty() {
        return Ok(None);
    }
    let named = choices.iter().find(|(name, _)| name.eq_ignore_ascii_case(value));
    named.map(|&(_, setting)| Some(setting)).ok_or(value)
}

#[cfg(test)]
mod tests {
    use super::choice;

    #[test]
    fn a_choice_ignores_case_and_spaces_and_gives_back_what_it_does_not_know() {
        let choices = [("on", 1), ("off", 0)];
        assert_eq!(choice(None, &choices), Ok(None));
        assert_eq!(choice(Some(" \t"), &choices), Ok(None));
        assert_eq!(choice(Some(" ON\n"), &choices), Ok(Some(1)));
        assert_eq!(choice(Some("off"), &choices), Ok(Some(0)));
        assert_eq!(choice(Some(" maybe "), &choices), Err("maybe"));
    }
}
