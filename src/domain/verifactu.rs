//! VERI*FACTU's record fingerprint (the *huella*, AEAT "Especificaciones
//! técnicas para la generación de la huella o hash de los registros"):
//! SHA-256 over `campo=valor` pairs joined by `&` in a fixed order, UTF-8,
//! written as 64 uppercase hex digits. The previous record's huella is one
//! of the fields (empty for the first record of an issuer), which chains
//! the records. The hash is over the exact text of each value (`150` and
//! `150.00` differ), so callers keep the strings as they were sent.

use sha2::{Digest, Sha256};

/// A billing record (*registro de alta*).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alta<'a> {
    /// `IDEmisorFactura`: the issuer's NIF.
    pub issuer: &'a str,
    /// `NumSerieFactura`: the invoice's number and series.
    pub number: &'a str,
    /// `FechaExpedicionFactura`, `dd-mm-yyyy`.
    pub issued_on: &'a str,
    /// `TipoFactura` (`F1`, `F2`, `R1`, ...).
    pub invoice_type: &'a str,
    /// `CuotaTotal`, as sent.
    pub tax_total: &'a str,
    /// `ImporteTotal`, as sent.
    pub total: &'a str,
    /// `Huella` of the issuer's previous record; empty for the first.
    pub previous: &'a str,
    /// `FechaHoraHusoGenRegistro`: when the record was made, ISO 8601
    /// with its offset.
    pub generated_at: &'a str,
}

/// A cancellation record (*registro de anulación*): a new link of the
/// chain; the record it cancels and its number stay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anulacion<'a> {
    /// `IDEmisorFacturaAnulada`.
    pub issuer: &'a str,
    /// `NumSerieFacturaAnulada`.
    pub number: &'a str,
    /// `FechaExpedicionFacturaAnulada`, `dd-mm-yyyy`.
    pub issued_on: &'a str,
    /// `Huella` of the issuer's previous record.
    pub previous: &'a str,
    /// `FechaHoraHusoGenRegistro`.
    pub generated_at: &'a str,
}

impl Alta<'_> {
    /// The exact text the huella is computed over.
    pub fn chained_text(&self) -> String {
        joined(&[
            ("IDEmisorFactura", self.issuer),
            ("NumSerieFactura", self.number),
            ("FechaExpedicionFactura", self.issued_on),
            ("TipoFactura", self.invoice_type),
            ("CuotaTotal", self.tax_total),
            ("ImporteTotal", self.total),
            ("Huella", self.previous),
            ("FechaHoraHusoGenRegistro", self.generated_at),
        ])
    }

    pub fn huella(&self) -> String {
        huella_of(&self.chained_text())
    }
}

impl Anulacion<'_> {
    /// The exact text the huella is computed over.
    pub fn chained_text(&self) -> String {
        joined(&[
            ("IDEmisorFacturaAnulada", self.issuer),
            ("NumSerieFacturaAnulada", self.number),
            ("FechaExpedicionFacturaAnulada", self.issued_on),
            ("Huella", self.previous),
            ("FechaHoraHusoGenRegistro", self.generated_at),
        ])
    }

    pub fn huella(&self) -> String {
        huella_of(&self.chained_text())
    }
}

fn joined(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// SHA-256 of the text, 64 uppercase hex digits.
fn huella_of(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three examples AEAT publishes, chained: two altas of one issuer
    /// and the anulación of the second.
    #[test]
    fn aeat_examples_hash_byte_for_byte() {
        let first = Alta {
            issuer: "89890001K",
            number: "12345678/G33",
            issued_on: "01-01-2024",
            invoice_type: "F1",
            tax_total: "12.35",
            total: "123.45",
            previous: "",
            generated_at: "2024-01-01T19:20:30+01:00",
        };
        assert_eq!(
            first.chained_text(),
            "IDEmisorFactura=89890001K&NumSerieFactura=12345678/G33&FechaExpedicionFactura=01-01-2024\
             &TipoFactura=F1&CuotaTotal=12.35&ImporteTotal=123.45&Huella=\
             &FechaHoraHusoGenRegistro=2024-01-01T19:20:30+01:00"
        );
        let first_huella = first.huella();
        assert_eq!(
            first_huella,
            "3C464DAF61ACB827C65FDA19F352A4E3BDC2C640E9E9FC4CC058073F38F12F60"
        );
        let second = Alta {
            number: "12345679/G34",
            previous: &first_huella,
            generated_at: "2024-01-01T19:20:35+01:00",
            ..first.clone()
        };
        let second_huella = second.huella();
        assert_eq!(
            second_huella,
            "F7B94CFD8924EDFF273501B01EE5153E4CE8F259766F88CF6ACB8935802A2B97"
        );
        let cancelled = Anulacion {
            issuer: "89890001K",
            number: "12345679/G34",
            issued_on: "01-01-2024",
            previous: &second_huella,
            generated_at: "2024-01-01T19:20:40+01:00",
        };
        assert_eq!(
            cancelled.huella(),
            "177547C0D57AC74748561D054A9CEC14B4C4EA23D1BEFD6F2E69E3A388F90C68"
        );
    }

    /// The hash is over the text as sent: the same amount written another
    /// way is another record.
    #[test]
    fn amounts_are_hashed_as_written() {
        let plain = Alta {
            issuer: "89890001K",
            number: "1",
            issued_on: "01-01-2024",
            invoice_type: "F1",
            tax_total: "150",
            total: "150",
            previous: "",
            generated_at: "2024-01-01T19:20:30+01:00",
        };
        let padded = Alta {
            total: "150.00",
            ..plain.clone()
        };
        assert_ne!(plain.huella(), padded.huella());
        assert_eq!(plain.huella().len(), 64);
        assert!(
            plain
                .huella()
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_lowercase())
        );
    }
}
