//! Reading a volume's string options.

use crate::{PolicyError, Volume};

/// The value of option `key`, if set and not blank.
pub fn get<'v>(volume: &'v Volume, key: &str) -> Option<&'v str> {
    volume
        .options
        .iter()
        .rev() // later keys override earlier ones, as in Flexvolume's merge
        .find(|kv| kv.key == key)
        .map(|kv| kv.value.trim())
        .filter(|v| !v.is_empty())
}

/// The value of a required option, or an error naming it and the volume.
pub fn required<'v>(volume: &'v Volume, key: &str) -> Result<&'v str, PolicyError> {
    get(volume, key).ok_or_else(|| {
        PolicyError::InvalidOptions(format!("volume {}: option \"{key}\" is required", volume.name))
    })
}

/// A comma-separated list option, blanks dropped.
pub fn list(volume: &Volume, key: &str) -> Vec<String> {
    get(volume, key)
        .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
        .unwrap_or_default()
}

/// The filesystem to use: the volume's fsType, else `default`; it must be
/// one of `allowed`.
pub fn fs_type(volume: &Volume, default: &str, allowed: &[&str]) -> Result<String, PolicyError> {
    let fs = if volume.fs_type.trim().is_empty() { default } else { volume.fs_type.trim() };
    if allowed.contains(&fs) {
        Ok(fs.to_string())
    } else {
        Err(PolicyError::Unsupported(format!(
            "volume {}: filesystem \"{fs}\" is not supported by backend {} (supported: {})",
            volume.name,
            volume.backend,
            allowed.join(", ")
        )))
    }
}

/// A yes/no option: "true" or "false" (default `default` when unset).
pub fn boolean(volume: &Volume, key: &str, default: bool) -> Result<bool, PolicyError> {
    match get(volume, key) {
        None => Ok(default),
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(PolicyError::InvalidOptions(format!(
            "volume {}: option \"{key}\" is \"{other}\", not true or false",
            volume.name
        ))),
    }
}

/// One of a fixed set of values, by name (`default` when unset); an error
/// lists the names.
pub fn choice<T: Copy>(
    volume: &Volume,
    key: &str,
    default: T,
    choices: &[(&str, T)],
) -> Result<T, PolicyError> {
    let Some(given) = get(volume, key) else { return Ok(default) };
    choices.iter().find(|(name, _)| *name == given).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        let listed = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        };
        PolicyError::InvalidOptions(format!(
            "volume {}: {key} \"{given}\" is not {listed}",
            volume.name
        ))
    })
}

/// A whole number in `range` (`default` when unset).
pub fn number<T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display>(
    volume: &Volume,
    key: &str,
    default: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, PolicyError> {
    let Some(given) = get(volume, key) else { return Ok(default) };
    given.parse::<T>().ok().filter(|n| range.contains(n)).ok_or_else(|| {
        PolicyError::InvalidOptions(format!(
            "volume {}: {key} \"{given}\" is not a number from {} to {}",
            volume.name,
            range.start(),
            range.end()
        ))
    })
}
